"""Mooncake Transfer Engine transport (pip ``mooncake-transfer-engine*``): the decode pulls byte ranges.

Why it looks like this (what Mooncake 0.3.13 does, checked on CPU hosts over protocol ``tcp``):

* ``P2PHANDSHAKE`` mode: no metadata server. Each engine listens on its own RPC port and its session
  name is ``host:rpc_port``; the peer learns it, with the buffer descriptors, from our ledger (the
  address below travels in the READY location as NIXL's metadata does).
* The protocol comes from the wheel that is installed (:func:`default_protocol`): ``-npu`` speaks
  ``ascend``, ``-non-cuda`` (and ``-efa-non-cuda``) ``tcp``, the CUDA builds ``rdma``. The
  ``protocol`` option overrides it. Both sides must speak the same one; a pull from a peer that speaks
  another is refused before a byte moves.
* One registration covers the whole KV cache when its regions are contiguous (vLLM allocates every
  layer back to back): regions are merged into extents (:func:`merge_extents`) and each extent is
  registered once. Mooncake refuses overlapping registrations, so the merge is needed anyway.
* A pull is ``batch_transfer_sync_read``: blocks adjacent on both sides are merged into one range
  (``base.coalesce``), and at most ``max_batch`` ranges go into one call, because the TCP transport
  queues at most 1,024 transfers per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) and an
  overflowing batch fails while part of it is still writing.
* The call blocks (and releases the GIL), so pulls run on ONE worker thread owned by the transport, as
  llm_datadist's do; :meth:`MooncakeTransport.poll` drains their results. A sync read cannot be cancelled,
  so the deadline of a stalled peer is the engine's: ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (set from
  ``progress_timeout_s`` before the engine starts, unless the environment sets it) drops a connection that
  made no progress for that long, and the read returns -1. We never report a failure while a read may
  still be writing, so the pull's deadline (``PullRequest.timeout_s``, else ``pull_timeout_s``) only fails
  pulls that waited in the queue past it.
* Mooncake answers every failure with -1. Which one it was is told by what follows: a read that ran for
  the progress timeout stalled (:class:`PullTimeout`); otherwise one-byte probe reads of the peer's first
  buffer (into a registered scratch byte, never a KV block) tell a live peer that refused the ranges
  (:class:`RemoteKVMissing`) from one that is gone (:class:`PeerUnreachable`).
* A refused batch returns at its first refusal while the rest of it is still queued on the connection;
  seen on 0.3.13: the next read then waited a second or was refused too. So the probes go on until one
  succeeds or the engine's admission timeout (``MC_TCP_ADMISSION_TIMEOUT_MS``, 1 s) has passed: the
  failure is reported, and the next pull starts, on a drained connection.

The ``mooncake`` import happens in the constructor, so this module imports without it.

Address exported by :meth:`MooncakeTransport.local_address`::

    {"kind": "mooncake", "session": "host:rpc_port", "host": str, "port": int, "protocol": str,
     "buffers": [[base, length], ...],  # the registered extents
     "regions": [{"name", "base_ptr", "block_len", "num_blocks", "stride"}, ...]}
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdgate.connector.transport.base import (
    KVRegion,
    PullRequest,
    PullResult,
    RemotePeer,
    Transport,
    byte_ranges,
    coalesce,
    drain,
    merge_extents,
)
from pdgate.connector.transport.errors import (
    EngineError,
    InvalidPull,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    RemoteKVMissing,
    TransportError,
)

logger = logging.getLogger(__name__)

__all__ = ["MAX_BATCH", "PROTOCOLS", "MooncakeTransport", "default_protocol"]

DEFAULT_PULL_TIMEOUT_S = 30.0
#: Ranges per ``batch_transfer_sync_read``: the TCP transport's default per-peer queue.
MAX_BATCH = 1024
PROTOCOLS = ("tcp", "rdma", "ascend")
# Wheel (distribution) -> the protocol it speaks; the first one installed wins.
_WHEEL_PROTOCOLS = (
    ("mooncake-transfer-engine-npu", "ascend"),
    ("mooncake-transfer-engine-non-cuda", "tcp"),
    ("mooncake-transfer-engine-efa-non-cuda", "tcp"),
    ("mooncake-transfer-engine", "rdma"),
    ("mooncake-transfer-engine-cuda13", "rdma"),
    ("mooncake-transfer-engine-efa", "rdma"),
    ("mooncake-transfer-engine-efa-cuda13", "rdma"),
    ("mooncake-transfer-engine-musa", "rdma"),
)
_ENV_PROGRESS = "MC_TCP_PROGRESS_TIMEOUT_SEC"


def default_protocol(installed: Iterable[str] | None = None) -> str:
    """The protocol of the Mooncake wheel that is installed (``installed``: distribution names, for tests).

    ``tcp`` when none is recognised: it is the one protocol every build has."""
    if installed is None:
        installed = {d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"]}
    names = {n.lower().replace("_", "-") for n in installed}
    for wheel, protocol in _WHEEL_PROTOCOLS:
        if wheel in names:
            return protocol
    return "tcp"


def _settle_s() -> float:
    """How long a refused batch's leftovers may linger on a connection: the TCP admission timeout, plus slack."""
    try:
        return float(os.environ.get("MC_TCP_ADMISSION_TIMEOUT_MS", "1000")) / 1000 + 0.5
    except ValueError:
        return 1.5


class _Remote:
    """A parsed peer address: its session, and its regions as the pull needs them."""

    def __init__(self, peer: RemotePeer, regions: list[KVRegion]) -> None:
        host, port, session = peer.get("host"), peer.get("port"), peer.get("session")
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise InvalidPull("mooncake peer address needs 'host' (str) and 'port' (1-65535)")
        if session != f"{host}:{port}":
            raise InvalidPull(f"mooncake peer session {session!r} is not its host:port {host}:{port}")
        self.host, self.port, self.session = host, port, session
        self.protocol = peer.get("protocol")
        self.regions = regions
        buffers = peer.get("buffers")
        if not isinstance(buffers, list) or not buffers:
            raise InvalidPull(f"mooncake peer {session} publishes no 'buffers'")
        spans = []
        for item in buffers:
            if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and v > 0 for v in item)):
                raise InvalidPull(f"mooncake peer {session}: buffer {item!r} is not [base, length]")
            spans.append((item[0], item[0] + item[1]))
        self.probe_addr = spans[0][0]  # one byte the peer serves for as long as it serves anything
        for r in regions:  # descriptors must name memory the peer registered, or the read is refused late
            if not any(s <= r.base_ptr and r.base_ptr + r.extent <= e for s, e in spans):
                raise InvalidPull(f"mooncake peer {session}: region {r.name!r} lies outside its registered buffers")


class MooncakeTransport(Transport):
    """Pull KV blocks with Mooncake's transfer engine. See the module docstring for the design."""

    kind = "mooncake"
    layerwise = True

    def __init__(
        self,
        *,
        hostname: str = "127.0.0.1",
        protocol: str | None = None,
        device_name: str = "",
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        progress_timeout_s: float | None = None,
        max_batch: int = MAX_BATCH,
        clock: Callable[[], float] = time.monotonic,
        engine_module: Any = None,
    ) -> None:
        if pull_timeout_s <= 0:
            raise ValueError("pull_timeout_s must be positive")
        if not 0 < max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH}")
        self.protocol = protocol or default_protocol()
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        progress = progress_timeout_s if progress_timeout_s is not None else pull_timeout_s
        # Read by the engine when it starts; an operator's own setting wins.
        os.environ.setdefault(_ENV_PROGRESS, str(max(1, math.ceil(progress))))
        self._progress_s = float(os.environ[_ENV_PROGRESS])
        # Lazy: this module must import without mooncake (vLLM imports the connector everywhere).
        mod: Any = engine_module if engine_module is not None else importlib.import_module("mooncake.engine")
        self.hostname = hostname
        self._timeout_s = pull_timeout_s
        self._max_batch = max_batch
        self._clock = clock
        self._engine: Any = mod.TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", self.protocol, device_name)
        if rc != 0:
            raise EngineError(f"mooncake initialize({hostname!r}, P2PHANDSHAKE, {self.protocol!r}) returned {rc}")
        self.port: int = int(self._engine.get_rpc_port())
        self.session = f"{hostname}:{self.port}"
        self._extents: list[tuple[int, int]] = []
        # One registered byte that probe reads land in (never a KV block): see _classify.
        self._scratch = ctypes.create_string_buffer(64)
        self._scratch_registered = False
        self._results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._pending_lock = threading.Lock()
        # One thread: a sync read blocks, and one owner keeps the engine's calls in order.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pdgate-mooncake-{self.port}")
        logger.info(
            "mooncake engine %s started (protocol %s, stall deadline %.0fs)",
            self.session,
            self.protocol,
            self._progress_s,
        )

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._check_registration(regions)
        extents = merge_extents(regions)
        rc = self._engine.batch_register_memory([s for s, _ in extents], [n for _, n in extents])
        if rc != 0:
            raise RegistrationError(f"mooncake batch_register_memory of {len(extents)} extents returned {rc}")
        self._extents = extents
        # Best effort: a protocol that cannot register host memory (ascend, for device KV) just probes less.
        self._scratch_registered = self._engine.register_memory(ctypes.addressof(self._scratch), 64) == 0
        if not self._scratch_registered:
            logger.warning(
                "mooncake %s: the probe byte could not be registered; failures read as unreachable", self.session
            )
        self._regions = tuple(regions)
        logger.info("mooncake %s registered %d regions as %d extents", self.session, len(regions), len(extents))

    def _address(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "host": self.hostname,
            "port": self.port,
            "protocol": self.protocol,
            "buffers": [[s, n] for s, n in self._extents],
        }

    # ------------------------------------------------------------------ pulls

    def start_pull(self, req: PullRequest) -> None:
        remote = _Remote(req.remote, self._admit_pull(req))
        if remote.protocol != self.protocol:
            raise InvalidPull(f"mooncake peer {remote.session} speaks {remote.protocol!r}, we speak {self.protocol!r}")
        with self._pending_lock:
            if req.transfer_id in self._pending:
                raise InvalidPull(f"transfer {req.transfer_id!r} is already in flight")
            self._pending.add(req.transfer_id)
        future = self._worker.submit(self._run_pull, req, remote, self._clock())
        future.add_done_callback(self._deliver)

    def poll(self) -> list[PullResult]:
        return drain(self._results, self._closed)

    def _close_engine(self) -> None:
        # Wait for a read in progress: it cannot be cancelled, and its destination must stay registered
        # until it ends (at the latest after the engine's progress timeout).
        self._worker.shutdown(wait=True, cancel_futures=True)
        scratch = [(ctypes.addressof(self._scratch), 64)] if self._scratch_registered else []
        for start, _ in self._extents + scratch:
            rc = self._engine.unregister_memory(start)
            if rc != 0:
                logger.warning("mooncake %s: unregister_memory(%#x) returned %d", self.session, start, rc)
        self._extents = []
        self._engine = None  # the engine stops when the last reference goes
        logger.info("mooncake engine %s closed", self.session)

    # ------------------------------------------------------------------ worker thread

    def _run_pull(self, req: PullRequest, remote: _Remote, submitted: float) -> PullResult:
        started = self._clock()
        timeout = req.timeout_s if req.timeout_s is not None else self._timeout_s
        if started - submitted > timeout:
            late = PullTimeout(f"pull {req.transfer_id} waited {started - submitted:.3f}s in the queue; not started")
            return PullResult.failure(req.transfer_id, late, elapsed_s=started - submitted)
        runs = coalesce(req.remote_block_ids, req.local_block_ids)
        ranges = [
            br
            for i in req.region_indexes(len(self._regions))
            for br in byte_ranges(runs, remote.regions[i], self._regions[i])
        ]
        for i in range(0, len(ranges), self._max_batch):
            chunk = ranges[i : i + self._max_batch]
            t0 = self._clock()
            try:
                rc = self._engine.batch_transfer_sync_read(
                    remote.session, [r.dst_addr for r in chunk], [r.src_addr for r in chunk], [r.nbytes for r in chunk]
                )
            except Exception as exc:  # a bug or an undocumented failure: still a typed result
                err: TransportError = EngineError(f"batch_transfer_sync_read raised {exc!r}")
                return PullResult.failure(req.transfer_id, err, elapsed_s=self._clock() - submitted)
            if rc != 0:
                err = self._classify(req.transfer_id, remote, rc, self._clock() - t0)
                return PullResult.failure(req.transfer_id, err, elapsed_s=self._clock() - submitted)
        nbytes = sum(r.nbytes for r in ranges)
        logger.debug(
            "pull %s: %d blocks in %d ranges from %s",
            req.transfer_id,
            len(req.local_block_ids),
            len(ranges),
            remote.session,
        )
        return PullResult.success(req.transfer_id, nbytes=nbytes, elapsed_s=self._clock() - submitted)

    def _classify(self, transfer_id: str, remote: _Remote, rc: int, took_s: float) -> TransportError:
        """Name the failure behind Mooncake's -1 (see the module docstring)."""
        what = f"pull {transfer_id} from {remote.session}"
        code = f"mooncake rc {rc}"
        if took_s >= self._progress_s * 0.9:
            return PullTimeout(f"{what}: no progress for {took_s:.1f}s (the engine's stall deadline)", engine_code=code)
        if self._probe(remote):
            return RemoteKVMissing(f"{what}: the peer refused the ranges (not registered there)", engine_code=code)
        return PeerUnreachable(f"{what}: the peer does not answer", engine_code=code)

    def _probe(self, remote: _Remote) -> bool:
        """Whether the peer still serves its first buffer: one-byte reads until one succeeds or the leftovers
        of the refused batch have had time to drain (a read right after a refusal may be refused too)."""
        deadline = self._clock() + _settle_s()
        scratch = ctypes.addressof(self._scratch)
        if not self._scratch_registered:
            time.sleep(_settle_s())  # still let a refused batch's leftovers drain before the next pull
            return False
        while True:
            if self._engine.transfer_sync_read(remote.session, scratch, remote.probe_addr, 1) == 0:
                return True
            if self._clock() >= deadline:
                return False
            time.sleep(0.05)

    def _deliver(self, future: Future[PullResult]) -> None:
        try:
            result = future.result()
        except Exception as exc:  # cancelled at close, or a bug in _run_pull: never lose the result
            logger.debug("mooncake pull ended without a result: %r", exc)
            return
        with self._pending_lock:
            self._pending.discard(result.transfer_id)
        self._results.put(result)

    def _label(self) -> str:
        return f"mooncake transport {self.session}"

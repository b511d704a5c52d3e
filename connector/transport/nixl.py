"""NIXL transport (pip ``nixl==1.5.1``, UCX backend): the portable pull-by-block-id path.

Why it looks like this (what NIXL 1.5 and its UCX backend do, checked on CPU hosts):

* ``enable_prog_thread=False``. The default progress thread busy-polls a whole core per agent
  even when idle. Without it someone must poll: the decode side polls ``check_xfer_state``
  and the prefill side polls ``get_new_notifs``. Both happen in :meth:`NixlTransport.poll`,
  so BOTH roles must call ``poll()`` regularly (over UCX's TCP transport a READ is emulated in
  software and needs the target to progress).
* Descriptor lists are prepared once: the local list at :meth:`register`, one remote list per
  peer on first contact. A pull is then ``make_prepped_xfer("READ", ...)`` by block index, one
  batched transfer for all regions. NIXL merges descriptors that are adjacent on both sides
  itself, so we do not pre-coalesce (see ``base.coalesce``); we log the run count only.
* ``UCX_NET_DEVICES``: UCX otherwise uses every interface, including the host's own eth0
  address for loopback traffic. Pass ``ucx_net_devices`` (e.g. ``"lo"`` in tests,
  ``"mlx5_0:1"`` on an RDMA host) and we set it before the agent (and its UCX context) is
  created; it is the only environment variable this module writes. If neither the argument
  nor the environment sets it we log a warning.
* NIXL is not thread-safe (``NIXL_THREAD_SYNC_NONE`` without the listener), which matches the
  one-owning-thread contract of ``base.Transport``.

The ``nixl`` import happens in the constructor, so this module imports without nixl.

Address exported by :meth:`NixlTransport.local_address` (what a puller needs)::

    {"kind": "nixl", "agent_name": str, "agent_metadata": base64 str,
     "mem_type": "DRAM" | "VRAM", "device_id": int,
     "regions": [{"name", "base_ptr", "block_len", "num_blocks", "stride"}, ...]}
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pdgate.connector.transport.base import (
    KVRegion,
    PullRequest,
    PullResult,
    RemotePeer,
    Transport,
    coalesce,
    merge_extents,
)
from pdgate.connector.transport.errors import (
    EngineError,
    InvalidPull,
    LinkError,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    TransportError,
)

logger = logging.getLogger(__name__)

__all__ = ["NixlTransport"]

DEFAULT_PULL_TIMEOUT_S = 30.0

# NIXL raises binding exceptions whose module depends on the installed variant
# (nixl_cu12._bindings vs nixl_cu13._bindings), so we map by class name.
_PEER_GONE = {"nixlRemoteDisconnectError", "nixlBackendError"}
_BAD_INPUT = {"nixlInvalidParamError", "nixlMismatchError", "nixlNotFoundError", "nixlNotSupportedError"}


def _map_nixl_error(exc: BaseException, what: str) -> TransportError:
    name = type(exc).__name__
    if name in _PEER_GONE:
        return PeerUnreachable(f"{what}: {exc}", engine_code=name)
    if name in _BAD_INPUT:
        return InvalidPull(f"{what}: {exc}", engine_code=name)
    if name == "nixlCancelledError":
        return LinkError(f"{what}: {exc}", engine_code=name)
    return EngineError(f"{what}: {exc!r}", engine_code=name)


def _block_table(regions: Sequence[KVRegion], device_id: int) -> tuple[np.ndarray, np.ndarray]:
    """N x 3 (addr, len, dev) rows, region-major, plus each region's first row index."""
    counts = [r.num_blocks for r in regions]
    offsets = np.zeros(len(regions), dtype=np.int64)
    if len(regions) > 1:
        offsets[1:] = np.cumsum(counts[:-1])
    rows = np.empty((sum(counts), 3), dtype=np.uint64)
    for r, off in zip(regions, offsets, strict=True):
        ids = np.arange(r.num_blocks, dtype=np.uint64)
        sl = slice(int(off), int(off) + r.num_blocks)
        rows[sl, 0] = np.uint64(r.base_ptr) + ids * np.uint64(r.stride)
        rows[sl, 1] = r.block_len
        rows[sl, 2] = device_id
    return rows, offsets


def _indices(offsets: np.ndarray, block_ids: Sequence[int]) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64)
    idx = (offsets[:, None] + ids[None, :]).reshape(-1)
    if idx.size and idx.max() > np.iinfo(np.int32).max:
        raise InvalidPull("descriptor index exceeds int32; too many blocks registered")
    return idx.astype(np.int32)


@dataclass
class _Peer:
    name: str
    metadata_digest: str
    regions: tuple[KVRegion, ...]
    offsets: np.ndarray
    dlist: Any  # nixl_prepped_dlist_handle


@dataclass
class _InFlight:
    handle: Any  # nixl_xfer_handle
    peer: str
    started: float
    deadline: float
    nbytes: int


class NixlTransport(Transport):
    """Pull KV blocks with NIXL over UCX. See the module docstring for the design."""

    kind = "nixl"
    layerwise = True

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        ucx_net_devices: str | None = None,
        mem_type: str = "DRAM",
        device_id: int = 0,
        backends: Sequence[str] = ("UCX",),
        clock: Callable[[], float] = time.monotonic,
        nixl_api: Any = None,
    ) -> None:
        if pull_timeout_s <= 0:
            raise ValueError("pull_timeout_s must be positive")
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {mem_type!r}")
        if ucx_net_devices:
            os.environ["UCX_NET_DEVICES"] = ucx_net_devices
        elif "UCX_NET_DEVICES" not in os.environ:
            logger.warning(
                "UCX_NET_DEVICES is not set: UCX will use every network interface. "
                "Pass ucx_net_devices (e.g. 'lo' for a single host) to pin it."
            )
        # Lazy: this module must import without nixl (vLLM imports the connector everywhere).
        api: Any = nixl_api if nixl_api is not None else importlib.import_module("nixl._api")

        self.name = agent_name or f"pdgate-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._timeout_s = pull_timeout_s
        self._mem_type = mem_type
        self._device_id = device_id
        self._clock = clock
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        try:
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise _map_nixl_error(exc, "creating the NIXL agent") from exc
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        self._local_offsets = np.zeros(0, dtype=np.int64)
        self._metadata_b64: str | None = None
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._ready: list[PullResult] = []
        self._served: list[str] = []
        self._zombies: list[Any] = []  # handles NIXL refused to release; retried on every poll
        logger.info("NIXL agent %s created (mem_type=%s, timeout=%.1fs)", self.name, mem_type, pull_timeout_s)

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._check_registration(regions)
        extents = [(start, length, self._device_id, "") for start, length in merge_extents(regions)]
        try:
            self._reg_descs = self._agent.register_memory(extents, self._mem_type)
            rows, offsets = _block_table(regions, self._device_id)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type)
            self._metadata_b64 = base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")
        except TransportError:
            raise
        except Exception as exc:
            raise RegistrationError(f"NIXL registration failed: {exc!r}", engine_code=type(exc).__name__) from exc
        self._regions = tuple(regions)
        self._local_offsets = offsets
        logger.info(
            "NIXL %s registered %d regions (%d extents, %d block descriptors)",
            self.name,
            len(regions),
            len(extents),
            len(rows),
        )

    def _address(self) -> dict[str, Any]:
        # The metadata carries the memory keys; register() sets it before the regions.
        return {
            "agent_name": self.name,
            "agent_metadata": self._metadata_b64,
            "mem_type": self._mem_type,
            "device_id": self._device_id,
        }

    # ------------------------------------------------------------------ pulls

    def start_pull(self, req: PullRequest) -> None:
        remote_regions = self._admit_pull(req)
        if req.transfer_id in self._inflight:
            raise InvalidPull(f"transfer {req.transfer_id!r} is already in flight")
        now = self._clock()
        try:
            peer = self._peer_for(req.remote, remote_regions)
        except InvalidPull:
            raise  # a malformed address never becomes valid: tell the caller now
        except TransportError as peer_err:
            self._ready.append(PullResult.failure(req.transfer_id, peer_err))
            return
        picked = list(req.region_indexes(len(self._regions)))  # one layer's regions for a layer-wise load
        local_idx = _indices(self._local_offsets[picked], req.local_block_ids)
        remote_idx = _indices(peer.offsets[picked], req.remote_block_ids)
        nbytes = len(req.local_block_ids) * sum(self._regions[i].block_len for i in picked)
        if logger.isEnabledFor(logging.DEBUG):
            runs = len(coalesce(req.remote_block_ids, req.local_block_ids))
            logger.debug("pull %s: %d blocks in %d runs from %s", req.transfer_id, len(local_idx), runs, peer.name)
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, local_idx, peer.dlist, remote_idx, req.transfer_id.encode()
            )
            state = self._agent.transfer(handle)
        except Exception as exc:
            err = _map_nixl_error(exc, f"posting pull {req.transfer_id} to {peer.name}")
            self._release(handle)
            self._fail_peer(peer.name, err)
            self._ready.append(PullResult.failure(req.transfer_id, err))
            return
        timeout = req.timeout_s if req.timeout_s is not None else self._timeout_s
        flight = _InFlight(handle, peer.name, now, now + timeout, nbytes)
        self._inflight[req.transfer_id] = flight
        if state != "PROC":
            self._finish(req.transfer_id, state, now)

    def poll(self) -> list[PullResult]:
        if self._closed:
            return []
        self._collect_notifs()
        now = self._clock()
        for transfer_id in list(self._inflight):
            flight = self._inflight.get(transfer_id)
            if flight is None:  # failed together with its peer earlier in this loop
                continue
            try:
                state = self._agent.check_xfer_state(flight.handle)
            except Exception as exc:
                err = _map_nixl_error(exc, f"checking pull {transfer_id}")
                self._inflight.pop(transfer_id)
                self._release(flight.handle)
                self._fail_peer(flight.peer, err)
                self._ready.append(PullResult.failure(transfer_id, err, elapsed_s=now - flight.started))
                continue
            if state == "PROC" and now >= flight.deadline:
                err = PullTimeout(
                    f"pull {transfer_id} from {flight.peer} still running after {flight.deadline - flight.started:.3f}s"
                )
                self._inflight.pop(transfer_id)
                self._release(flight.handle)  # NIXL cancels an active transfer on release
                self._fail_peer(flight.peer, err)
                self._ready.append(PullResult.failure(transfer_id, err, elapsed_s=now - flight.started))
            elif state != "PROC":
                self._finish(transfer_id, state, now)
        self._retry_zombies()
        out, self._ready = self._ready, []
        return out

    def drain_served(self) -> list[str]:
        self._collect_notifs()
        out, self._served = self._served, []
        return out

    def _close_engine(self) -> None:
        for flight in self._inflight.values():
            self._release(flight.handle)
        self._inflight.clear()
        for name in list(self._peers):
            self._drop_peer(name)
        self._release_dlist(self._local_dlist)
        self._local_dlist = None
        self._retry_zombies()
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception as exc:
                logger.warning("NIXL %s: deregister_memory failed: %r", self.name, exc)
        self._agent = None
        logger.info("NIXL agent %s closed", self.name)

    # ------------------------------------------------------------------ internals

    def _label(self) -> str:
        return f"NIXL transport {self.name}"

    def _peer_for(self, remote: RemotePeer, regions: list[KVRegion]) -> _Peer:
        name = remote.get("agent_name")
        md_b64 = remote.get("agent_metadata")
        if not isinstance(name, str) or not isinstance(md_b64, str):
            raise InvalidPull("nixl peer address needs 'agent_name' and 'agent_metadata' strings")
        digest = hashlib.sha256(md_b64.encode()).hexdigest()
        peer = self._peers.get(name)
        if peer is not None and peer.metadata_digest == digest:
            return peer
        if peer is not None:  # same name, new metadata: the peer restarted or re-registered
            logger.info("NIXL peer %s changed its metadata; reloading", name)
            self._drop_peer(name)
        try:
            metadata = base64.b64decode(md_b64, validate=True)
        except ValueError:
            raise InvalidPull(f"agent_metadata of {name} is not valid base64") from None
        logger.info("NIXL %s: loading peer %s", self.name, name)
        t0 = time.monotonic()
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _map_nixl_error(exc, f"loading metadata of peer {name}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            self._remove_remote(loaded_name)
            raise InvalidPull(f"peer address says agent {name!r} but its metadata is for {loaded_name!r}")
        mem_type, device_id = remote.get("mem_type", "DRAM"), remote.get("device_id", 0)
        if mem_type not in ("DRAM", "VRAM") or not isinstance(device_id, int):
            self._remove_remote(name)
            raise InvalidPull(f"peer {name} has mem_type {mem_type!r} / device_id {device_id!r}")
        rows, offsets = _block_table(regions, device_id)
        try:
            dlist = self._agent.prep_xfer_dlist(name, rows, mem_type)
        except Exception as exc:
            self._remove_remote(name)
            raise _map_nixl_error(exc, f"preparing descriptors of peer {name}") from exc
        peer = _Peer(name, digest, tuple(regions), offsets, dlist)
        self._peers[name] = peer
        logger.info(
            "NIXL %s: peer %s added (%d block descriptors) in %.3fs", self.name, name, len(rows), time.monotonic() - t0
        )
        return peer

    def _finish(self, transfer_id: str, state: str, now: float) -> None:
        flight = self._inflight.pop(transfer_id)
        self._release(flight.handle)
        elapsed = now - flight.started
        if state == "DONE":
            self._ready.append(PullResult.success(transfer_id, nbytes=flight.nbytes, elapsed_s=elapsed))
            return
        err = PeerUnreachable(f"pull {transfer_id} from {flight.peer} ended in state {state}", engine_code="NIXL_ERR")
        self._fail_peer(flight.peer, err)
        self._ready.append(PullResult.failure(transfer_id, err, elapsed_s=elapsed))

    def _fail_peer(self, name: str, cause: TransportError) -> None:
        """Forget a peer after a wire failure so the next pull reloads it from scratch, and fail
        the other pulls still running against it (their link is the one that just broke)."""
        if isinstance(cause, InvalidPull):
            return
        now = self._clock()
        for transfer_id, flight in list(self._inflight.items()):
            if flight.peer != name:
                continue
            self._inflight.pop(transfer_id)
            self._release(flight.handle)
            err = type(cause)(f"aborted: peer {name} was dropped ({cause.message})", engine_code=cause.engine_code)
            self._ready.append(PullResult.failure(transfer_id, err, elapsed_s=now - flight.started))
        self._drop_peer(name)

    def _drop_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            self._release_dlist(peer.dlist)
        self._remove_remote(name)

    def _remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone, or never fully loaded
            logger.debug("NIXL remove_remote_agent(%s): %r", name, exc)

    def _release(self, handle: Any) -> None:
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            # NIXL could not cancel it: the destination blocks may still be written. Keep the
            # handle and retry; the caller already got a failure and must not reuse the blocks
            # until the request is finished in the ledger.
            logger.warning("NIXL %s: releasing a transfer handle failed (%r); will retry", self.name, exc)
            self._zombies.append(handle)

    def _retry_zombies(self) -> None:
        pending, self._zombies = self._zombies, []
        for handle in pending:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                self._zombies.append(handle)

    def _release_dlist(self, dlist: Any) -> None:
        if dlist is None:
            return
        try:
            self._agent.release_dlist_handle(dlist)
        except Exception as exc:
            logger.debug("NIXL release_dlist_handle: %r", exc)

    def _collect_notifs(self) -> None:
        if self._closed:
            return
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:
            logger.warning("NIXL %s: get_new_notifs failed: %r", self.name, exc)
            return
        for msgs in notifs.values():
            for msg in msgs:
                self._served.append(msg.decode(errors="replace") if isinstance(msg, bytes) else str(msg))

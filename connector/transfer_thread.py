"""The worker half's transfer thread: the one thread that owns the transport (`worker.py` says why).

It constructs the transport, registers the KV regions, submits the pulls the model-runner thread queues
(`PullJob`), polls, and hands `PullOutcome`s back on its outbox. Everything it shares with other threads
goes through its two `queue.SimpleQueue`s, so NIXL (not thread-safe) and llm_datadist (serialised calls)
only ever see this thread.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdgate.connector.layerwise import TAIL, LayerDone, LayerTally, part_key
from pdgate.connector.logs import about
from pdgate.connector.metadata import PullOutcome
from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult, Transport
from pdgate.connector.transport.errors import EngineError, TransportError

__all__ = ["Holding", "PullJob", "TransferThread"]

logger = logging.getLogger(__name__)

# Poll cadence of the transfer thread (seconds). Pull in flight: start fast, back off to the cap.
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.002
_HOLD_POLL_S = 0.0005  # prefill holding blocks: the target side must progress emulated READs
_IDLE_POLL_S = 0.1
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PullJob:
    """One pull for the thread to submit."""

    req_id: str
    transfer_id: str
    kv_key: int
    remote: Mapping[str, Any]
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    timeout_s: float | None = None  # None: the transport's own deadline
    # A layer-wise load (`layerwise.py`): the region indexes of each layer, pulled one pull per layer in
    # this order, each ending in a `LayerDone` on the thread's `layers` queue before the job's outcome.
    layers: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class Holding:
    """How many transfers the prefill holds: the thread polls often while any is held."""

    count: int


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Started:
    address: dict[str, Any] | None
    error: BaseException | None


class TransferThread:
    """Owns the transport. Everything it shares with other threads goes through its two queues."""

    def __init__(
        self,
        factory: Callable[[], Transport],
        regions: Sequence[KVRegion],
        *,
        tp_rank: int,
        corrupt: bool,
        fail_layer: int | None = None,
    ) -> None:
        self._factory = factory
        self._regions = tuple(regions)
        self._tp_rank = tp_rank
        self._corrupt = corrupt
        self._fail_layer = fail_layer  # TEST ONLY (`test_fail_layer`): this layer's read fails
        self.inbox: queue.SimpleQueue[PullJob | Holding | _Stop] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[PullOutcome] = queue.SimpleQueue()
        self.layers: queue.SimpleQueue[LayerDone] = queue.SimpleQueue()
        # transport id of one layer's pull -> (the job's key, the layers it covers); the job's tally by key
        self._parts: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._tallies: dict[str, LayerTally] = {}
        self._started: queue.SimpleQueue[_Started] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pdgate-xfer-tp{tp_rank}", daemon=True)

    def start(self, timeout: float = _START_TIMEOUT_S) -> dict[str, Any]:
        self._thread.start()
        try:
            started = self._started.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the KV transport did not start within {timeout:.0f}s") from None
        if started.error is not None:
            raise started.error
        assert started.address is not None
        return started.address

    def stop(self, timeout: float = 5.0) -> None:
        self.inbox.put(_Stop())
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            transport = self._factory()
            transport.register(self._regions)
            address = transport.local_address()
        except BaseException as exc:
            self._started.put(_Started(None, exc))
            return
        self._started.put(_Started(address, None))
        inflight: dict[str, PullJob] = {}
        holding = 0
        delay = _POLL_MIN_S
        try:
            while True:
                if inflight:
                    timeout: float | None = delay
                    delay = min(delay * 2, _POLL_MAX_S)
                elif holding:
                    timeout = _HOLD_POLL_S
                else:
                    timeout = _IDLE_POLL_S
                msgs = []
                try:
                    msgs.append(self.inbox.get(timeout=timeout))
                    while True:
                        msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    pass
                for msg in msgs:
                    if isinstance(msg, _Stop):
                        return
                    if isinstance(msg, Holding):
                        holding = msg.count
                    else:
                        self._submit(transport, msg, inflight)
                        delay = _POLL_MIN_S
                for result in transport.poll():
                    self._finish(result, inflight)
                served = transport.drain_served()
                if served and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("peers finished reading %s", served)
        finally:
            transport.close()

    def _submit(self, transport: Transport, job: PullJob, inflight: dict[str, PullJob]) -> None:
        # The transport keys a pull by its id: siblings of one handoff (vLLM's n > 1) each pull the same
        # transfer into their own blocks, so a second one in flight gets an id of its own.
        taken = job.transfer_id in inflight or job.transfer_id in self._tallies
        key = f"{job.transfer_id}#{job.req_id}" if taken else job.transfer_id
        req = PullRequest(
            transfer_id=key,
            kv_key=job.kv_key,
            remote=job.remote,
            remote_block_ids=job.remote_block_ids,
            local_block_ids=job.local_block_ids,
            timeout_s=job.timeout_s,
        )
        if job.layers:
            self._submit_layers(transport, job, key, req, inflight)
            return
        inflight[key] = job
        try:
            transport.start_pull(req)
        except TransportError as exc:
            self._finish(PullResult.failure(key, exc), inflight)

    def _submit_layers(
        self, transport: Transport, job: PullJob, key: str, req: PullRequest, inflight: dict[str, PullJob]
    ) -> None:
        """The last block first, every layer (`TAIL`: the step writes into it, `layerwise.py`), until it
        ended (the transport's deadline ends it), then one pull per layer of the other blocks, in layer
        order. A transport that cannot pull some regions only (`Transport.layerwise`), or a one-block load,
        is pulled whole at once, and every layer ends with it."""
        assert job.layers is not None
        n = len(job.layers)
        self._tallies[key] = LayerTally(key, n + 1)
        parts: list[tuple[str, tuple[int, ...], PullRequest]]
        if transport.layerwise and len(req.local_block_ids) > 1:
            head = replace(req, remote_block_ids=req.remote_block_ids[:-1], local_block_ids=req.local_block_ids[:-1])
            tail = replace(req, remote_block_ids=req.remote_block_ids[-1:], local_block_ids=req.local_block_ids[-1:])
            parts = [(part_key(key, TAIL), (TAIL,), tail)]
            parts += [(part_key(key, i), (i,), replace(head, regions=r)) for i, r in enumerate(job.layers)]
        else:
            parts = [(part_key(key, 0), (TAIL, *range(n)), req)]
        for pkey, layers, _ in parts:
            self._parts[pkey] = (key, layers)
            inflight[pkey] = job
        for pkey, layers, part in parts:
            if self._fail_layer in layers:
                err = EngineError(f"TEST ONLY (test_fail_layer): the read of layer {self._fail_layer} failed")
                self._finish(PullResult.failure(pkey, err), inflight)
                continue
            try:
                transport.start_pull(replace(part, transfer_id=pkey))
            except TransportError as exc:
                self._finish(PullResult.failure(pkey, exc), inflight)
            # Poll between posts: posting costs (NIXL ~0.6 ms a pull), and layer 0 must not wait for the others'.
            for result in transport.poll():
                self._finish(result, inflight)
            # The forward waits for the last block alone: the layers' posts (no progress thread) would delay it.
            while layers == (TAIL,) and pkey in self._parts:
                time.sleep(_POLL_MIN_S)
                for result in transport.poll():
                    self._finish(result, inflight)

    def _finish(self, result: PullResult, inflight: dict[str, PullJob]) -> None:
        part = self._parts.pop(result.transfer_id, None)
        if part is not None:  # one layer's pull of a layer-wise job
            key, layers = part
            job = inflight.pop(result.transfer_id, None)
            assert job is not None
            for layer in layers:
                self.layers.put(LayerDone(job.req_id, job.transfer_id, layer, result.ok))
            if not self._tallies[key].add(layers, result):
                return
            result = self._tallies.pop(key).result()
            inflight[key] = job
        job = inflight.pop(result.transfer_id, None)
        if job is None:
            logger.warning(
                "transport reported unknown transfer %s", result.transfer_id, extra=about(result.transfer_id)
            )
            return
        if result.ok and self._corrupt:
            _xor_blocks(self._regions, job.local_block_ids)
        err = result.error
        self.outbox.put(
            PullOutcome(
                req_id=job.req_id,
                transfer_id=job.transfer_id,
                tp_rank=self._tp_rank,
                ok=result.ok,
                code=err.code if err is not None else None,
                message=str(err) if err is not None else None,
                nbytes=result.nbytes,
                nblocks=len(job.local_block_ids) if result.ok else 0,
                elapsed_s=result.elapsed_s,
            )
        )


def _xor_blocks(regions: Iterable[KVRegion], block_ids: Iterable[int]) -> None:
    """TEST ONLY (`corrupt_pulled_bytes`): flip bits of the pulled blocks, in host memory."""
    import numpy as np

    ids = list(block_ids)
    for region in regions:
        for b in ids:
            buf = (ctypes.c_uint8 * region.block_len).from_address(region.block_addr(b))
            np.ctypeslib.as_array(buf)[...] ^= 0x5A

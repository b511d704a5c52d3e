"""The worker half: owns the transport and moves blocks off the forward path.

One worker per TP rank (vLLM worker process). The model-runner thread only touches plain Python state
here and two `queue.SimpleQueue`s; the transport lives entirely on one background thread
("pdgate-xfer"), which constructs it, registers the KV regions, submits pulls, polls, and hands
`PullOutcome`s back (`transfer_thread.py`). NIXL is not thread-safe and llm_datadist serialises its
calls, so "one owning thread" is the transport contract (`connector/transport/base.py`), not just tidiness.

Per step (`StepMetadata` from the scheduler half):
  pulls     -> submitted to the thread; the outcome travels back to the scheduler half in the worker
               metadata (vLLM aggregates it over the workers). A pull under the router's claim
               (`RecvPlan.trusted_until`) that ends before that bound, or fails, is reported finished
               receiving by this worker in the step it ends (`PullOutcome.reported`), as NIXL's worker
               does: no round trip through the scheduler half, so no extra engine step.
               A synchronous pull (`RecvPlan.sync`) is waited for right here, in `start_load_kv` before
               the forward that reads it, and is never reported as finished receiving (vLLM expects no
               report); a failed or late one only reports its blocks as load errors, in the same step.
  recv_done -> reported as finished receiving once no pull of ours is still writing into the blocks;
               a failed one also reports its blocks through `get_block_ids_with_load_errors`.
  holds     -> the prefill keeps blocks for a decode: the thread polls the transport often, because
               NIXL without a progress thread needs the *target* to make progress over TCP.
  frees     -> reported as finished sending (every worker reports it; vLLM frees when all did).

A synchronous pull of at least `layerwise_min_tokens` goes layer by layer (`layerwise.py`): `start_load_kv`
submits it and waits for its last block only, `wait_for_layer_load` waits for one layer each, and the step's
end (`wait_for_save`, `get_finished`) waits for the rest, so no read outlives the step that reports its blocks.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.errors import ConfigError
from pdgate.connector.layerwise import TAIL, layer_groups, use_layerwise
from pdgate.connector.metadata import PullOutcome, RecvDone, StepMetadata
from pdgate.connector.transfer_thread import Holding, PullJob, TransferThread
from pdgate.connector.transport.base import KVRegion, Transport

from pdgate.errors import Code

__all__ = ["WorkerHalf", "kv_device_index", "regions_from_kv_caches"]

logger = logging.getLogger(__name__)

# An idle engine step (`StepMetadata.idle`: no request computes, the engine only polls KV transfers) lets
# `get_finished` block this long for a pull in flight to end, instead of returning at once. Without it the
# engine spun through empty steps (vLLM sleeps 1 ms after each, and each is a round trip to the worker
# process) while the pull ran, and a finished pull waited 1-2 ms for the next step to see it (measured at
# one request at a time, tiny model, 2 cores); with it the step that starts the pull reports it ~0.1 ms
# after it ends, and the spinning no longer takes CPU from the transfer thread and the prefill. Blocking
# costs nothing when no request computes; a request that arrives meanwhile waits at most this long.
_IDLE_WAIT_S = 0.005


def regions_from_kv_caches(kv_caches: Mapping[str, Any]) -> list[KVRegion]:
    """One `KVRegion` per KV tensor, dim 0 = block id.

    vLLM (CPU/GPU) gives one tensor per layer, `[num_blocks, kv_heads, block_size, head+head_v]`, all
    views into one buffer; vllm-ascend gives a tuple per layer (`(k, v)`, MLA `(nope, rope)`). Each
    block must be one contiguous run of bytes (true for the layouts above; a layout that splits a block
    would need a region per slice, refused here with the reason). Layers sharing one tensor are
    registered once.
    """
    regions: list[KVRegion] = []
    seen: set[tuple[int, int, int]] = set()
    for layer, value in kv_caches.items():
        tensors = list(value) if isinstance(value, (tuple, list)) else [value]
        for i, t in enumerate(tensors):
            name = layer if len(tensors) == 1 else f"{layer}.{i}"
            shape = tuple(t.shape)
            if len(shape) < 2:
                raise ValueError(f"KV tensor {name} has shape {shape}; expected [num_blocks, ...]")
            elem = t.element_size()
            block_elems = 1
            for d in shape[1:]:
                block_elems *= d
            if not t[0].is_contiguous():
                raise ValueError(
                    f"KV tensor {name} (shape {shape}, strides {tuple(t.stride())}) does not keep a block "
                    "contiguous; this layout needs one region per slice, which the connector does not build"
                )
            key = (t.data_ptr(), shape[0], t.stride(0))
            if key in seen:
                continue
            seen.add(key)
            regions.append(
                KVRegion(
                    name=name,
                    base_ptr=t.data_ptr(),
                    block_len=block_elems * elem,
                    num_blocks=shape[0],
                    stride=t.stride(0) * elem,
                )
            )
    if not regions:
        raise ValueError("register_kv_caches got no KV tensors")
    return regions


def kv_device_index(kv_caches: Mapping[str, Any]) -> int | None:
    """Index of the accelerator holding the KV cache (`npu:3` -> 3); None for host memory.

    The llm_datadist transport initialises on this device, so it is read from the tensors themselves
    rather than from the thread-local "current device" (the transfer thread never set one).
    """
    devices = {
        (t.device.type, t.device.index)
        for v in kv_caches.values()
        for t in (v if isinstance(v, (tuple, list)) else [v])
    }
    if len(devices) > 1:
        raise ValueError(f"KV cache tensors span several devices {sorted(devices, key=str)}; expected one")
    if not devices:
        return None
    kind, index = devices.pop()
    if kind == "cpu":
        return None
    return index or 0


@dataclass
class _Layered:
    """A layer-wise pull of this step: when it was submitted (perf counter), the layers seen landing in the
    forward's waits, and when the last of them was seen (wall clock)."""

    started: float
    landed: set[int] = field(default_factory=set)
    seen_at: float | None = None
    tail_s: float = 0.0  # how long `start_load_kv` waited for the last block (`layerwise.TAIL`)


class WorkerHalf:
    """See the module docstring. Model-runner thread only (apart from the transfer thread it owns)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        tp_rank: int,
        transport_factory: Callable[[], Transport],
        wall: Callable[[], float] = time.time,
        block_size: int | None = None,
    ) -> None:
        self._cfg = cfg
        self._wall = wall
        self.tp_rank = tp_rank
        self._factory = transport_factory
        self._thread: TransferThread | None = None
        self.address: dict[str, Any] | None = None
        self.device_index: int | None = None  # accelerator of the KV cache, known once it is registered
        self._inflight: dict[str, str] = {}  # req_id -> transfer_id of a pull still writing
        self._completions: dict[str, RecvDone] = {}
        # req_id -> (trusted_until, local blocks) of a pull under the router's claim, still in flight
        self._trusted: dict[str, tuple[float, tuple[int, ...]]] = {}
        # req_id -> when it was handed to the transfer thread, for the synchronous pulls of this step
        self._sync_started: dict[str, float] = {}
        self._holding: set[str] = set()
        self._frees: set[str] = set()
        self._outcomes: list[PullOutcome] = []
        self._load_errors: set[int] = set()
        self._idle = False  # this step computes nothing (`StepMetadata.idle`): get_finished may wait
        self._block_size = block_size
        self._layer_of: dict[str, int] = {}  # layer name -> index into `_layers` (the layer-wise order)
        self._layers: tuple[tuple[int, ...], ...] = ()  # each layer's region indexes
        # req_id -> (when submitted, the layers landed) of the layer-wise pulls of this step
        self._layered: dict[str, _Layered] = {}
        # (layer index, seconds `wait_for_layer_load` blocked) of the latest layer waits, for measurement
        self.layer_waits: deque[tuple[int, float]] = deque(maxlen=4096)
        self._step_waits: list[tuple[int, float]] = []  # this step's, for the load's log line

    # ---- set-up -----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> dict[str, Any]:
        if self._cfg.corrupt_pulled_bytes:
            devices = {str(t.device) for v in kv_caches.values() for t in (v if isinstance(v, (tuple, list)) else [v])}
            if devices != {"cpu"}:
                raise ConfigError("corrupt_pulled_bytes (test only) works on CPU KV caches only")
            logger.warning("corrupt_pulled_bytes is on: pulled KV will be XORed (negative-control test mode)")
        regions = regions_from_kv_caches(kv_caches)
        if self._thread is not None:
            raise RuntimeError("register_kv_caches called twice")
        self.device_index = kv_device_index(kv_caches)
        groups = layer_groups(kv_caches.keys(), regions)
        self._layer_of = {name: i for i, name in enumerate(groups)}
        self._layers = tuple(groups.values())
        fail_layer = self._cfg.test_fail_layer
        thread = TransferThread(
            self._factory,
            regions,
            tp_rank=self.tp_rank,
            corrupt=self._cfg.corrupt_pulled_bytes,
            fail_layer=None if fail_layer is None else int(fail_layer),
        )
        self.address = thread.start()
        self._thread = thread
        logger.info(
            "tp rank %d: %d KV regions registered with %s (%d blocks of %d B per region)",
            self.tp_rank,
            len(regions),
            self.address.get("kind"),
            regions[0].num_blocks,
            regions[0].block_len,
        )
        return self.address

    # ---- per step ---------------------------------------------------------------------------------

    def on_step(self, step: StepMetadata) -> None:
        self._idle = step.idle
        for plan in step.pulls:
            if self._thread is None or self.tp_rank >= len(plan.sources):
                why = "no KV caches registered" if self._thread is None else f"no source for tp rank {self.tp_rank}"
                trusted = plan.trusted_until is not None
                if plan.sync:  # no report of a synchronous load: its blocks fail in this step
                    self._load_errors.update(plan.local_block_ids)
                elif trusted:  # report it failed now, as for any failed pull under the router's claim
                    self._completions[plan.req_id] = RecvDone(plan.req_id, False, plan.local_block_ids)
                self._outcomes.append(
                    PullOutcome(
                        plan.req_id,
                        plan.transfer_id,
                        self.tp_rank,
                        False,
                        Code.TRANSPORT_BAD_REQUEST,
                        why,
                        reported=trusted,
                    )
                )
                continue
            self._inflight[plan.req_id] = plan.transfer_id
            if plan.trusted_until is not None:
                self._trusted[plan.req_id] = (plan.trusted_until, plan.local_block_ids)
            layered = plan.sync and use_layerwise(
                self._cfg.layerwise_min_tokens, len(plan.local_block_ids), self._block_size, len(self._layers)
            )
            if layered:
                self._layered[plan.req_id] = _Layered(time.perf_counter())
            elif plan.sync:
                self._sync_started[plan.req_id] = time.perf_counter()
            self._thread.inbox.put(
                PullJob(
                    plan.req_id,
                    plan.transfer_id,
                    plan.kv_key,
                    plan.sources[self.tp_rank],
                    plan.remote_block_ids,
                    plan.local_block_ids,
                    # A synchronous pull holds the engine's step: a stalled peer may hold it this long at most.
                    min(self._cfg.sync_pull_timeout_s, self._cfg.pull_timeout_s) if plan.sync else None,
                    self._layers if layered else None,
                )
            )
        for done in step.recv_done:
            if done.ranks is not None and self.tp_rank not in done.ranks:
                continue
            if done.sync:  # vLLM expects no report of a synchronous load: only its failed blocks
                if not done.ok:
                    self._load_errors.update(done.local_block_ids)
            else:
                self._completions[done.req_id] = done
        if step.holds or step.frees:
            self._holding.update(step.holds)
            self._holding.difference_update(step.frees)
            self._frees.update(step.frees)
            if self._thread is not None:
                self._thread.inbox.put(Holding(len(self._holding)))
        if self._sync_started:
            self._await_sync()
        if self._layered:  # the last block, which the step writes into, lands before the forward
            t0 = time.perf_counter()
            self._await_layer(TAIL)
            for entry in self._layered.values():
                entry.tail_s = time.perf_counter() - t0

    def _await_sync(self) -> None:
        """Block until every synchronous pull of this step ended. The transport ends each pull by its
        deadline (`sync_pull_timeout_s`), so this returns; it never returns while one may still write into
        blocks that vLLM is about to read (or, after a failure, to free), unless the transfer thread died."""
        thread = self._thread
        assert thread is not None
        while self._sync_started:
            if not thread.alive():
                for req_id in list(self._sync_started):
                    self._sync_outcome_lost(req_id, "the transfer thread stopped")
                return
            self._drain(wait_s=0.5)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer `layer_name` of every layer-wise pull of this step ended (landed or failed: a
        failed one only fails its request, at the step's end); its time blocked goes to `layer_waits`."""
        layer = self._layer_of.get(layer_name)
        if layer is None or self._thread is None or not self._layered:
            return
        t0 = time.perf_counter()
        self._await_layer(layer)
        waited = (layer, time.perf_counter() - t0)
        self.layer_waits.append(waited)
        self._step_waits.append(waited)

    def _await_layer(self, layer: int) -> None:
        """Until part `layer` (a layer's index, or `TAIL`) of every layer-wise pull of this step ended, or
        the transfer thread stopped (the step's end then reports the pulls lost)."""
        thread = self._thread
        assert thread is not None
        while any(layer not in entry.landed for entry in self._layered.values()):
            if not thread.alive():
                break
            try:
                done = thread.layers.get(timeout=0.5)
            except queue.Empty:
                continue
            entry = self._layered.get(done.req_id)
            if entry is not None and self._inflight.get(done.req_id) == done.transfer_id:
                entry.landed.add(done.layer)
                entry.seen_at = self._wall()

    def finish_layered(self) -> None:
        """The step's end: wait until every layer-wise pull of the step ended, as `_await_sync` does for a
        whole one (the transport ends each by its deadline), and forget their layer events."""
        thread = self._thread
        while self._layered and thread is not None:
            if not thread.alive():
                for req_id in list(self._layered):
                    self._sync_outcome_lost(req_id, "the transfer thread stopped")
                break
            self._drain(wait_s=0.5)
        while thread is not None:
            try:
                thread.layers.get_nowait()
            except queue.Empty:
                break

    def _log_layered(self, oc: PullOutcome, tail_s: float) -> PullOutcome:
        """One line per layer-wise load: how long the forward blocked on each layer (in wait order) against
        how long the transport took, the overlap `docs/TRANSFER.md` reports; the outcome carries the wait
        order on to the scheduler half's counters (`layerwise.layer_counts`)."""
        waits, self._step_waits = self._step_waits, []
        logger.info(
            "transfer %s: %s loaded layer by layer (%s): %d layers, transport %.2f ms, last block first %.2f ms, "
            "forward blocked %.2f ms (per layer, in wait order: %s)",
            oc.transfer_id,
            oc.req_id,
            "ok" if oc.ok else f"failed: {oc.code.value if oc.code else '?'}",
            len(self._layers),
            oc.elapsed_s * 1e3,
            tail_s * 1e3,
            sum(w for _, w in waits) * 1e3,
            " ".join(f"{layer}:{w * 1e3:.3f}" for layer, w in waits),
        )
        return replace(oc, layer_order=tuple(layer for layer, _ in waits))

    def _sync_outcome_lost(self, req_id: str, why: str) -> None:
        transfer_id = self._inflight.pop(req_id, "")
        _, local = self._trusted.pop(req_id, (0.0, ()))
        self._sync_started.pop(req_id, None)
        self._layered.pop(req_id, None)
        self._load_errors.update(local)
        self._outcomes.append(
            PullOutcome(req_id, transfer_id, self.tp_rank, False, Code.TRANSPORT_CLOSED, why, reported=True)
        )

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests finished sending and receiving. In an idle step with a pull in flight, first wait up to
        `_IDLE_WAIT_S` for a pull to end, so that it is reported in this very step."""
        self.finish_layered()
        wait = _IDLE_WAIT_S if self._idle and self._inflight else 0.0
        self._idle = False  # once per step
        self._drain(wait)
        recving: set[str] = set()
        for req_id, done in list(self._completions.items()):
            if req_id in self._inflight:
                continue  # our pull may still write into these blocks; report once it stopped
            recving.add(req_id)
            if not done.ok:
                self._load_errors.update(done.local_block_ids)
            del self._completions[req_id]
        sending, self._frees = self._frees, set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_outcomes(self, *, drain: bool = True) -> list[PullOutcome]:
        """The pull outcomes gathered so far. The facade passes `drain=False`: vLLM calls it right after
        `get_finished`, and an outcome the transfer thread produced in between then waits for the next
        step's `get_finished`, so a pull's outcome and its own finished report travel in the same step."""
        if drain:
            self._drain()
        out, self._outcomes = self._outcomes, []
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def _drain(self, wait_s: float = 0.0) -> None:
        """Take the transfer thread's outcomes; with `wait_s`, block up to that long for the first one."""
        if self._thread is None:
            return
        outbox = self._thread.outbox
        while True:
            try:
                oc = outbox.get(timeout=wait_s) if wait_s > 0 else outbox.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if self._inflight.get(oc.req_id) == oc.transfer_id:
                del self._inflight[oc.req_id]
                trusted = self._trusted.pop(oc.req_id, None)
                started = self._sync_started.pop(oc.req_id, None)
                layered = self._layered.pop(oc.req_id, None)
                ended_at = None
                if layered is not None:
                    started = layered.started
                    # Every layer seen landing in the forward's waits: the pull ended by then (the claim's bound
                    # is about when the read ended, not when the step's end looked).
                    every = layered.landed.issuperset(range(len(self._layers)))
                    ended_at = layered.seen_at if every else None
                    oc = self._log_layered(oc, layered.tail_s)
                if started is not None and trusted is not None:
                    oc = self._report_sync(oc, time.perf_counter() - started, *trusted, ended_at=ended_at)
                elif trusted is not None:
                    oc = self._report_trusted(oc, *trusted)
            self._outcomes.append(oc)

    def _report_sync(
        self, oc: PullOutcome, waited_s: float, until: float, local: tuple[int, ...], *, ended_at: float | None = None
    ) -> PullOutcome:
        """A synchronous pull ended (at `ended_at`, wall clock; None: now): nothing to report to vLLM when it
        succeeded within the router's claim; otherwise its blocks are load errors of this step (a late one
        cannot wait for DONE here)."""
        if oc.ok and (self._wall() if ended_at is None else ended_at) >= until:
            oc = replace(
                oc,
                ok=False,
                code=Code.KV_LOAD_TIMEOUT,
                message="the synchronous pull ended past the router claim's bound (no DONE can confirm it in time)",
            )
        if not oc.ok:
            self._load_errors.update(local)
        return replace(oc, reported=True, waited_s=waited_s)

    def _report_trusted(self, oc: PullOutcome, until: float, local: tuple[int, ...]) -> PullOutcome:
        """A pull under the router's claim ended: report it finished now (`get_finished` of this step)
        when it failed, or succeeded before `until`; a success past `until` waits for the scheduler half's
        DONE-confirmed RecvDone. A RecvDone already here (the load hit its deadline) is what counts."""
        if oc.req_id in self._completions:
            return oc
        if not oc.ok:
            self._completions[oc.req_id] = RecvDone(oc.req_id, False, local)
        elif self._wall() < until:
            self._completions[oc.req_id] = RecvDone(oc.req_id, True)
        else:
            return oc
        return replace(oc, reported=True)

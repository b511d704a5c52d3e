"""The scheduler half: pure bookkeeping of holds (prefill) and pulls (decode), in the engine-core thread.

No device imports, no sockets, no clock: vLLM's objects are read duck-typed (`request.request_id`,
`request.status.name`, `blocks.blocks[0][i].block_hash`), `now` is an argument, and every piece of
metaserver I/O leaves as a command in `take_commands()` and comes back through `on_result()`. The facade
(`connector.py`) moves those between this object and the control thread.

The work splits by side, one module each: `scheduler_prefill.py` (`PrefillSide`: hold a finished prompt's
blocks until the ledger lets them go) and `scheduler_decode.py` (`DecodeSide`: claim, pull, report; its
docstring says why a pull may be used before DONE is recorded). A request goes to one side by its
`kv_transfer_params` (`do_remote_decode` / `do_remote_prefill`, vLLM's keys, read like every field
through `pdgate.contract.KVTransferParams.parse`: a flag that is not a boolean is refused); a `both`
engine serves either. This class routes vLLM's hooks and the control thread's results to the side they concern and
collects, each step, what the workers must do. The KV location a prefill records and a decode checks is
built and read in `location.py`; the counters are listed in `counters.py`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.location import EngineFacts, addresses_from_workers
from pdgate.connector.messages import (
    CheckResult,
    Claimed,
    ClaimFailed,
    Command,
    DoneResult,
    FeedStatus,
    ReadyFailed,
    ReadyRecorded,
    Registered,
    Result,
    Terminal,
)
from pdgate.connector.metadata import PullOutcome, StepMetadata
from pdgate.connector.outbox import Outbox
from pdgate.connector.scheduler_decode import DecodeSide
from pdgate.connector.scheduler_prefill import PrefillSide

from pdgate.contract import InvalidTransferParams, KVTransferParams
from pdgate.models import InstanceLoad, TransportAddress

__all__ = ["SchedulerHalf", "idle_step"]

logger = logging.getLogger(__name__)


def idle_step(num_scheduled_tokens: int, dp_size: int) -> bool:
    """Whether the workers may block in this step's `get_finished` for a pull (`StepMetadata.idle`):
    nothing is computed in it, and no other engine steps in lockstep with this one. Under data
    parallelism an engine with nothing to compute still runs dummy batches for its peers' collectives,
    so a wait there would hold every rank up."""
    return num_scheduled_tokens == 0 and dp_size == 1


_NEITHER = KVTransferParams()
_FLAGS = ("do_remote_decode", "do_remote_prefill")


def _flags(request: Any) -> KVTransferParams:
    """The request's side, read through the contract's typed parse of its `kv_transfer_params`, cut to
    the two flags so a bad field elsewhere still reaches the side that reports it (a decode then fails the
    load visibly). A flag that is not a boolean raises `InvalidTransferParams`: the string "false" is
    refused, never taken as true."""
    params = request.kv_transfer_params
    if not params:
        return _NEITHER
    if isinstance(params, Mapping):
        params = {key: params.get(key) for key in _FLAGS}
    return KVTransferParams.parse(params)


def _wants_remote_prefill(request: Any) -> bool:
    try:
        return _flags(request).do_remote_prefill
    except InvalidTransferParams:
        return False  # served as a plain request; `request_finished` counts and logs it


class SchedulerHalf:
    """See the module docstring. One instance per engine core (per DP rank); engine-core thread only."""

    def __init__(self, cfg: ConnectorConfig, facts: EngineFacts) -> None:
        self._cfg = cfg
        self._facts = facts
        self._out = Outbox()
        self._prefill = PrefillSide(cfg, facts, self._out)
        self._decode = DecodeSide(cfg, facts, self._out)
        self._live_requests = 0

    # ---- setup ------------------------------------------------------------------------------------

    def set_addresses(self, addresses: Mapping[int, Mapping[str, Any]]) -> list[TransportAddress]:
        """The workers' transport addresses by TP rank (from vLLM's handshake metadata)."""
        self._prefill.addresses = addresses_from_workers(addresses)
        return list(self._prefill.addresses)

    @property
    def addresses(self) -> list[TransportAddress]:
        return list(self._prefill.addresses)

    # ---- vLLM scheduler hooks -----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._live_requests += 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """How many prompt tokens this request will load, and whether asynchronously (`DecodeSide`)."""
        if not _wants_remote_prefill(request):
            return 0, False
        # This request is the engine's only one (vLLM told us of it before asking), and no other loads.
        alone = self._live_requests <= 1 and self._decode.loading == 0
        return self._decode.get_num_new_matched_tokens(request, num_computed_tokens, alone=alone)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, *, now: float) -> None:
        if _wants_remote_prefill(request):
            self._decode.update_state_after_alloc(request, blocks, num_external_tokens, now=now)

    def request_finished(
        self, request: Any, block_ids: Sequence[int], *, now: float
    ) -> tuple[bool, dict[str, Any] | None]:
        self._live_requests = max(self._live_requests - 1, 0)
        try:
            flags = _flags(request)
        except InvalidTransferParams as exc:
            self._out.bump("bad_params")
            logger.error("request %s: %s; served as a plain request", request.request_id, exc)
            return False, None
        if flags.do_remote_prefill:
            self._decode.request_finished(request, now=now)
            return False, None
        if not flags.do_remote_decode:
            return False, None
        return self._prefill.request_finished(request, block_ids, now=now)

    def build(self, finished_req_ids: Iterable[str], *, now: float, idle: bool = False) -> StepMetadata:
        """Drain everything the workers must act on this step (vLLM's `build_connector_meta`); `idle`: no
        request computes in this step (`StepMetadata.idle`)."""
        holds, frees = self._prefill.take_step(finished_req_ids, now=now)
        pulls, recv_done = self._decode.take_step(now)
        return StepMetadata(pulls, recv_done, holds, frees, idle=idle)

    def on_worker_output(self, outcomes: Sequence[PullOutcome], *, now: float) -> None:
        """Per-rank pull outcomes (aggregated over the workers by vLLM, possibly over several steps)."""
        self._decode.on_worker_output(outcomes, now=now)

    def on_result(self, result: Result, *, now: float) -> None:
        """A control-thread answer, handed to the side it concerns."""
        if isinstance(result, FeedStatus):
            self._prefill.on_feed(result)
        elif isinstance(result, Terminal):
            self._prefill.on_terminal(result)
        elif isinstance(result, ReadyRecorded):
            self._prefill.on_ready_recorded(result, now)
        elif isinstance(result, ReadyFailed):
            self._prefill.on_ready_failed(result)
        elif isinstance(result, CheckResult):
            self._prefill.on_check(result)
        elif isinstance(result, Claimed):
            self._decode.on_claimed(result, now)
        elif isinstance(result, ClaimFailed):
            self._decode.on_claim_failed(result)
        elif isinstance(result, DoneResult):
            self._decode.on_done(result, now)
        elif isinstance(result, Registered):
            self._out.bump("registrations")

    # ---- queries ------------------------------------------------------------------------------------

    def take_commands(self) -> list[Command]:
        return self._out.take_commands()

    @property
    def counters(self) -> dict[str, int]:
        return self._out.counters

    @property
    def counters_version(self) -> int:
        """Changes on every counter bump, so the facade knows when to publish."""
        return self._out.version

    def has_holds(self) -> bool:
        return bool(self._prefill.held_transfer_ids())

    def held_transfer_ids(self) -> list[str]:
        return self._prefill.held_transfer_ids()

    def load_figures(self) -> tuple[int, int]:
        """(running, waiting): the requests this engine holds, those still loading their KV counted as
        waiting. Plain ints, asked at every step (`PDGateConnector._publish`)."""
        waiting = self._decode.loading
        return max(self._live_requests - waiting, 0), waiting

    def load(self, kv_usage: float) -> InstanceLoad:
        running, waiting = self.load_figures()
        return InstanceLoad(running=running, waiting=waiting, kv_usage=min(max(kv_usage, 0.0), 1.0))

    def snapshot(self) -> dict[str, Any]:
        return {
            "instance_id": self._facts.instance_id,
            "role": self._cfg.role,
            "counters": dict(self._out.counters),
            "holding": len(self._prefill.held_transfer_ids()),
            "receiving": self._decode.loading,
            "claim_ms": _summary(self._decode.claim_latency_ms()),
        }


def _summary(samples: list[float]) -> dict[str, float]:
    """Count, median, p99 and max of the latest samples (nearest rank); empty when there are none."""
    if not samples:
        return {}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(ordered[min(n - 1, max(0, math.ceil(q * n) - 1))], 3)

    return {"n": n, "p50": rank(0.5), "p99": rank(0.99), "max": round(ordered[-1], 3)}

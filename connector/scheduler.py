"""The scheduler half: pure bookkeeping of holds (prefill) and pulls (decode), in the engine-core thread.

No device imports, no sockets, no clock: vLLM's objects are read duck-typed (`request.request_id`,
`request.status.name`, `blocks.blocks[0][i].block_hash`), `now` is an argument, and every piece of
metaserver I/O leaves as a command in `take_commands()` and comes back through `on_result()`. The facade
(`connector.py`) moves those between this object and the control thread. The KV location a prefill
records and a decode checks is built and read in `location.py`; the counters are listed in `counters.py`.

Prefill (a request with `do_remote_decode`):
  request_finished -> hold the blocks, command MarkReady, return the params the router forwards to D.
  A terminal state for the transfer (event feed, a failed MarkReady, a Check) -> the workers report the
  request as finished sending (vLLM frees the blocks). If the metaserver has been unreachable for longer
  than the lease + margin, the blocks are freed on that local deadline instead (counted).

Decode (a request with `do_remote_prefill`):
  get_num_new_matched_tokens -> (prompt tokens to load, async); update_state_after_alloc -> command
  Claim, and, when the params carry the prefill's location (`remote_location`), a RecvPlan for the
  workers at once (the pull runs while the claim is in flight); otherwise Claimed -> the RecvPlan.
  Claimed (ledger location equal to the one pulled from) + every worker's PullOutcome ok -> the workers
  report the request as finished receiving, and command Done goes out without being waited for. Any
  failure (claim, layout, location mismatch, pull, deadline) -> the workers report it finished with its
  blocks as load errors (vLLM then fails or recomputes it, per `kv_load_failure_policy`) and the handoff
  is aborted so P frees at once.

Why the pulled data may be used without waiting for DONE (or for the claim before the pull starts):
  P holds a transfer's blocks from `request_finished` (before its answer reaches the router, hence
  before D sees the params) until the ledger record is terminal (DONE, ABORTED, EXPIRED), or until its
  local deadline (lease + margin, tens of seconds, with the metaserver unreachable). Terminal states are
  final, so a successful claim at ledger time t_c proves the record was live, and the blocks held, for
  the whole read up to t_c. After t_c the record is CLAIMED by us: it cannot expire before the claim
  lease lapses (a lapse returns it to READY, still live), and DONE is ours to write. It can still be
  ABORTED: by us (we then fail the load anyway), by P shutting down (its memory goes with it, so the
  read fails), or by the router, which aborts only when it has given up on this decode's answer (client
  gone, decode failed or timed out), so nothing computed from these blocks reaches a client. Hence: a
  pull that D observed finished within the claim lease, measured from when D sent the claim (t_c is
  later), read held blocks. Past that bound, D falls back to waiting for DONE (a refusal with the
  record gone is a load error, as before). The ledger stays the authority on where the KV is: the
  early plan is used only if the claimed record yields the very same plan.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdgate.connector.blocks import tokens_to_load
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.counters import COUNTERS
from pdgate.connector.location import (
    EngineFacts,
    LocationError,
    addresses_from_workers,
    location_for,
    plan_for,
    plan_from_location,
)
from pdgate.connector.messages import (
    Abort,
    Check,
    CheckResult,
    Claim,
    Claimed,
    ClaimFailed,
    Command,
    Done,
    DoneResult,
    FeedStatus,
    MarkReady,
    ReadyFailed,
    ReadyRecorded,
    Registered,
    Result,
    Terminal,
)
from pdgate.connector.metadata import (
    DecodeParams,
    InvalidTransferParams,
    PrefillParams,
    PullOutcome,
    RecvDone,
    RecvPlan,
    StepMetadata,
    prefill_result_params,
)
from pdgate.metaserver.models import TERMINAL_STATES, InstanceLoad, TransportAddress

# COUNTERS (counters.py) and EngineFacts (location.py) are re-exported for older imports.
__all__ = ["COUNTERS", "EngineFacts", "SchedulerHalf"]

logger = logging.getLogger(__name__)

_KEEP_STATUSES = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


@dataclass
class _Hold:
    req_id: str
    transfer_id: str
    finished_at: float
    lease_s: float
    next_check_at: float
    announced: bool = False  # vLLM has listed the id in finished_req_ids (workers may report it)
    free_reason: str | None = None


class _RecvState(enum.Enum):
    CLAIMING = "claiming"  # no pull yet: waiting for the claim (and the ledger's location)
    PULLING = "pulling"  # the workers are pulling (claimed or not yet)
    PULLED = "pulled"  # every worker pulled; waiting for the claim
    CONFIRMING = "confirming"  # claimed and pulled, but past the claim lease: waiting for DONE


@dataclass
class _Recv:
    req_id: str
    transfer_id: str
    local_block_ids: tuple[int, ...]
    hit_blocks: int
    num_tokens: int
    deadline: float
    state: _RecvState = _RecvState.CLAIMING
    outcomes: dict[int, PullOutcome] = field(default_factory=dict)
    early: RecvPlan | None = None  # the plan started from the params' location, before the claim
    claimed: bool = False
    claim_lease_s: float = 0.0
    # Monotonic stamps of each phase, for the one log line per transfer. `started_at` is also when the
    # claim was sent (the ledger's claim time is later), the base of the claim-lease bound.
    started_at: float = 0.0
    claimed_at: float | None = None
    pull_started_at: float | None = None
    pulled_at: float | None = None


def plan_from_params(location: Any, facts: EngineFacts, dp: DecodeParams, rec: _Recv) -> RecvPlan:
    """The early pull, from the prefill's copy of its READY record (checked against the ledger later)."""
    assert dp.kv_key is not None
    return plan_for(
        location,
        facts,
        transfer_id=dp.transfer_id,
        kv_key=dp.kv_key,
        req_id=rec.req_id,
        local_block_ids=rec.local_block_ids,
        hit_blocks=rec.hit_blocks,
    )


class SchedulerHalf:
    """See the module docstring. One instance per engine core (per DP rank); engine-core thread only."""

    def __init__(self, cfg: ConnectorConfig, facts: EngineFacts) -> None:
        self._cfg = cfg
        self._facts = facts
        self._commands: list[Command] = []
        self._holds: dict[str, _Hold] = {}  # transfer_id -> hold
        self._hold_by_req: dict[str, str] = {}  # req_id -> transfer_id
        self._recv: dict[str, _Recv] = {}  # req_id -> pull in progress
        self._recv_by_tid: dict[str, str] = {}  # transfer_id -> req_id
        self._consumed: set[str] = set()  # decode req ids whose handoff was set up or released
        self._new_pulls: list[RecvPlan] = []
        self._new_done: list[RecvDone] = []
        self._new_holds: list[str] = []
        self._addresses: list[TransportAddress] = []
        self._last_feed_ok: float | None = None
        self._live_requests = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.counters_version = 0  # bumped on every change, so the facade knows when to publish

    # ---- setup ------------------------------------------------------------------------------------

    def set_addresses(self, addresses: Mapping[int, Mapping[str, Any]]) -> list[TransportAddress]:
        """The workers' transport addresses by TP rank (from vLLM's handshake metadata)."""
        self._addresses = addresses_from_workers(addresses)
        return list(self._addresses)

    @property
    def addresses(self) -> list[TransportAddress]:
        return list(self._addresses)

    # ---- vLLM scheduler hooks -----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._live_requests += 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free: how many prompt tokens this request will load asynchronously."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._consumed:
            return 0, False
        try:
            remote_num_tokens = DecodeParams.parse(params).remote_num_tokens
        except InvalidTransferParams:
            # Still take the async path: the load then fails visibly (load errors) instead of the
            # request silently being prefilled here.
            remote_num_tokens = None
        count = tokens_to_load(request.num_prompt_tokens, remote_num_tokens, num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, *, now: float) -> None:
        params = request.kv_transfer_params
        rid = request.request_id
        if not params or not params.get("do_remote_prefill") or rid in self._consumed:
            return
        self._consumed.add(rid)
        try:
            dp = DecodeParams.parse(params)
        except InvalidTransferParams as exc:
            self._bump("bad_params")
            logger.error("request %s: %s", rid, exc)
            dp = None
        if num_external_tokens <= 0:
            # Nothing to load (e.g. the prefix was cached here): release the prefill's blocks now.
            if dp is not None:
                self._bump("recv_released")
                self._commands.append(Abort(dp.transfer_id, "decode did not need the KV (local prefix cache hit)"))
            return
        group = blocks.blocks[0] if blocks.blocks else ()
        hit = 0
        for block in group:
            if block.block_hash is None or block.is_null:
                break
            hit += 1
        local = tuple(b.block_id for b in group if b.block_hash is None and not b.is_null)
        self._bump("recv_started")
        if dp is None:
            self._new_done.append(RecvDone(rid, False, local))
            self._count_failure(len(local))
            return
        if dp.transfer_id in self._recv_by_tid:
            logger.error("transfer %s: a second decode request (%s) carries it; failing it", dp.transfer_id, rid)
            self._new_done.append(RecvDone(rid, False, local))
            self._count_failure(len(local))
            return
        deadline = now + self._cfg.ready_wait_s + self._cfg.pull_timeout_s + self._cfg.free_margin_s
        rec = _Recv(rid, dp.transfer_id, local, hit, num_external_tokens, deadline, started_at=now)
        self._recv[rid] = rec
        self._recv_by_tid[dp.transfer_id] = rid
        self._commands.append(Claim(dp.transfer_id))
        if dp.location is not None and dp.kv_key is not None:
            try:
                rec.early = plan_from_params(dp.location, self._facts, dp, rec)
            except LocationError as exc:
                # Only a hint: the claimed record decides (and fails the load if it is this same location).
                logger.debug("transfer %s: no early pull (%s): %s", dp.transfer_id, exc.code, exc.message)
            else:
                rec.state = _RecvState.PULLING
                rec.pull_started_at = now
                self._new_pulls.append(rec.early)
        logger.debug("transfer %s: decode %s claims, %d local blocks (%d cached)", dp.transfer_id, rid, len(local), hit)

    def request_finished(
        self, request: Any, block_ids: Sequence[int], *, now: float
    ) -> tuple[bool, dict[str, Any] | None]:
        self._live_requests = max(self._live_requests - 1, 0)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            self._decode_finished(request, params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        return self._prefill_finished(request, params, block_ids, now)

    def build(self, finished_req_ids: Iterable[str], *, now: float) -> StepMetadata:
        """Drain everything the workers must act on this step (vLLM's `build_connector_meta`)."""
        for rid in finished_req_ids:
            tid = self._hold_by_req.get(rid)
            if tid is not None:
                self._holds[tid].announced = True
        self._check_holds(now)
        self._check_recv_deadlines(now)
        frees = []
        for tid, hold in list(self._holds.items()):
            if hold.free_reason is not None and hold.announced:
                frees.append(hold.req_id)
                del self._holds[tid]
                del self._hold_by_req[hold.req_id]
        step = StepMetadata(tuple(self._new_pulls), tuple(self._new_done), tuple(self._new_holds), tuple(frees))
        self._new_pulls, self._new_done, self._new_holds = [], [], []
        return step

    def on_worker_output(self, outcomes: Sequence[PullOutcome], *, now: float) -> None:
        """Per-rank pull outcomes (aggregated over the workers by vLLM, possibly over several steps)."""
        for oc in outcomes:
            rec = self._recv.get(oc.req_id)
            if rec is None or rec.transfer_id != oc.transfer_id or rec.state is not _RecvState.PULLING:
                continue  # a late outcome for a request already failed (deadline) or finished
            rec.outcomes[oc.tp_rank] = oc
            if oc.ok:
                self._bump("blocks_pulled", oc.nblocks)
                self._bump("bytes_pulled", oc.nbytes)
            else:
                self._bump("pulls_failed")
            if len(rec.outcomes) < self._facts.world_size:
                continue
            failed = [o for o in rec.outcomes.values() if not o.ok]
            if failed:
                first = failed[0]
                self._fail(rec, first.code or "pull_failed", f"tp rank {first.tp_rank}: {first.message}", abort=True)
            else:
                rec.pulled_at = now
                if rec.claimed:
                    self._pulled_and_claimed(rec, now)
                else:
                    rec.state = _RecvState.PULLED

    def on_result(self, result: Result, *, now: float) -> None:
        """A control-thread answer."""
        if isinstance(result, FeedStatus):
            if result.ok and (self._last_feed_ok is None or result.at > self._last_feed_ok):
                self._last_feed_ok = result.at
        elif isinstance(result, Terminal):
            self._free_hold(result.transfer_id, result.state.lower())
        elif isinstance(result, ReadyRecorded):
            hold = self._holds.get(result.transfer_id)
            self._bump("ready_recorded")
            if hold is not None:
                hold.lease_s = result.lease_s
                hold.next_check_at = now + result.lease_s + self._cfg.free_margin_s
        elif isinstance(result, ReadyFailed):
            self._bump("ready_failed")
            logger.warning("transfer %s: READY not recorded (%s): %s", result.transfer_id, result.code, result.message)
            if result.terminal:
                self._free_hold(result.transfer_id, "ready_failed")
        elif isinstance(result, CheckResult):
            if not result.found:
                self._free_hold(result.transfer_id, "not_found")
            elif result.state is not None and result.state in TERMINAL_STATES:
                self._free_hold(result.transfer_id, result.state.value.lower())
        elif isinstance(result, Claimed):
            self._on_claimed(result, now)
        elif isinstance(result, ClaimFailed):
            self._bump("claims_failed")
            rec = self._recv_for(result.transfer_id)
            if rec is not None and not rec.claimed:
                terminal = result.code in ("gone", "not_found")
                self._fail(rec, result.code, result.message, abort=not terminal)
        elif isinstance(result, DoneResult):
            rec = self._recv_for(result.transfer_id)
            if rec is not None and rec.state is _RecvState.CONFIRMING:
                if result.valid:
                    self._complete_ok(rec, now)
                else:
                    self._fail(rec, result.code or "done_failed", result.message or "", abort=result.code != "gone")
        elif isinstance(result, Registered):
            self._bump("registrations")

    # ---- queries ------------------------------------------------------------------------------------

    def take_commands(self) -> list[Command]:
        out, self._commands = self._commands, []
        return out

    def has_holds(self) -> bool:
        return bool(self._holds)

    def load(self, kv_usage: float) -> InstanceLoad:
        waiting = sum(1 for r in self._recv.values())
        running = max(self._live_requests - waiting, 0)
        return InstanceLoad(running=running, waiting=waiting, kv_usage=min(max(kv_usage, 0.0), 1.0))

    def held_transfer_ids(self) -> list[str]:
        return list(self._holds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "instance_id": self._facts.instance_id,
            "role": self._cfg.role,
            "counters": dict(self.counters),
            "holding": len(self._holds),
            "receiving": len(self._recv),
        }

    # ---- prefill side -------------------------------------------------------------------------------

    def _prefill_finished(
        self, request: Any, params: Mapping[str, Any], block_ids: Sequence[int], now: float
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if request.status.name not in _KEEP_STATUSES or not block_ids:
            # Aborted or failed before a finished prefill, or no KV at all: nothing to keep.
            self._bump("prefill_not_kept")
            return False, None
        try:
            pp = PrefillParams.parse(params)
        except InvalidTransferParams as exc:
            self._bump("bad_params")
            self._bump("prefill_not_kept")
            logger.error("prefill %s: %s; its KV is not kept", rid, exc)
            return False, None
        if pp.transfer_id in self._holds:
            self._bump("prefill_not_kept")
            logger.error(
                "prefill %s: transfer %s is already held by %s", rid, pp.transfer_id, self._holds[pp.transfer_id].req_id
            )
            return False, None
        f = self._facts
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        location, kept = location_for(
            f, block_ids=block_ids, num_tokens=num_tokens, addresses=self._addresses, remote_request_id=rid
        )
        lease = self._cfg.kv_lease_s
        self._holds[pp.transfer_id] = _Hold(rid, pp.transfer_id, now, lease, now + lease + self._cfg.free_margin_s)
        self._hold_by_req[rid] = pp.transfer_id
        self._new_holds.append(rid)
        self._commands.append(MarkReady(pp.transfer_id, location))
        self._bump("sends_held")
        logger.debug("transfer %s: prefill %s holds %d blocks (%d tokens)", pp.transfer_id, rid, len(kept), num_tokens)
        return True, prefill_result_params(
            transfer_id=pp.transfer_id,
            kv_key=pp.kv_key,
            block_ids=kept,
            num_tokens=num_tokens,
            engine_id=f.engine_id,
            prefill_instance_id=f.instance_id,
            remote_request_id=rid,
            location=location,
        )

    def _free_hold(self, transfer_id: str, reason: str) -> None:
        hold = self._holds.get(transfer_id)
        if hold is None or hold.free_reason is not None:
            return
        hold.free_reason = reason
        key = f"sends_freed_{reason}"
        self._bump(key if key in COUNTERS else "sends_freed_not_found")
        logger.debug("transfer %s: freeing prefill %s (%s)", transfer_id, hold.req_id, reason)

    def _check_holds(self, now: float) -> None:
        margin = self._cfg.free_margin_s
        for hold in self._holds.values():
            if hold.free_reason is not None or now < hold.next_check_at:
                continue
            limit = hold.lease_s + margin
            feed_stale = self._last_feed_ok is None or now - self._last_feed_ok > limit
            if feed_stale and now - hold.finished_at > limit:
                logger.warning(
                    "transfer %s: no word from the metaserver for over %.0fs; freeing prefill %s locally",
                    hold.transfer_id,
                    limit,
                    hold.req_id,
                )
                self._free_hold(hold.transfer_id, "local_deadline")
            else:
                # The feed is alive but said nothing about this transfer: ask (a lost event or record).
                self._commands.append(Check(hold.transfer_id))
                hold.next_check_at = now + hold.lease_s

    # ---- decode side --------------------------------------------------------------------------------

    def _decode_finished(self, request: Any, params: Mapping[str, Any]) -> None:
        rid = request.request_id
        if rid in self._consumed:
            # Set up (or released) already; an in-flight pull finishes on its own and vLLM keeps the
            # blocks until it is reported.
            self._consumed.discard(rid)
            return
        # Finished before it was ever scheduled (aborted, rejected): tell the prefill to free now.
        try:
            tid = DecodeParams.parse(params).transfer_id
        except InvalidTransferParams:
            self._bump("bad_params")
            return
        self._bump("recv_released")
        self._commands.append(Abort(tid, "decode request ended before its KV was pulled"))

    def _recv_for(self, transfer_id: str) -> _Recv | None:
        rid = self._recv_by_tid.get(transfer_id)
        return self._recv.get(rid) if rid is not None else None

    def _on_claimed(self, result: Claimed, now: float) -> None:
        rec = self._recv_for(result.transfer_id)
        if rec is None or rec.claimed:
            return
        rec.claimed_at = now
        try:
            plan = plan_from_location(
                result.handoff,
                self._facts,
                req_id=rec.req_id,
                local_block_ids=rec.local_block_ids,
                hit_blocks=rec.hit_blocks,
            )
        except LocationError as exc:
            self._fail(rec, exc.code, exc.message, abort=True)
            return
        rec.claimed = True
        rec.claim_lease_s = result.handoff.lease_s
        if rec.early is None:
            rec.state = _RecvState.PULLING
            rec.pull_started_at = now
            self._new_pulls.append(plan)
            return
        if plan != rec.early:
            self._fail(
                rec,
                "pd_location_mismatch",
                "the ledger's KV location differs from the one in kv_transfer_params (pulled from the latter)",
                abort=True,
            )
            return
        if rec.state is _RecvState.PULLED:
            self._pulled_and_claimed(rec, now)

    def _pulled_and_claimed(self, rec: _Recv, now: float) -> None:
        """Report the load now if the pull ended within the claim lease; else wait for DONE (see top)."""
        self._commands.append(Done(rec.transfer_id))
        # Half the lease: room for the metaserver's clock running at another rate than ours.
        if now - rec.started_at < rec.claim_lease_s / 2:
            self._complete_ok(rec, now)
        else:
            rec.state = _RecvState.CONFIRMING

    def _check_recv_deadlines(self, now: float) -> None:
        for rec in list(self._recv.values()):
            if now >= rec.deadline:
                self._fail(rec, "pd_kv_timeout", f"KV load still {rec.state.value} at its deadline", abort=True)

    def _complete_ok(self, rec: _Recv, now: float) -> None:
        # claim: until the claim's answer; pull: from the plan to every worker's outcome (it overlaps the
        # claim when it started early); confirm: from the later of the two to the report.
        claimed = rec.claimed_at if rec.claimed_at is not None else now
        pulled = rec.pulled_at if rec.pulled_at is not None else now
        pull_from = rec.pull_started_at if rec.pull_started_at is not None else claimed
        pull_s = max((o.elapsed_s for o in rec.outcomes.values()), default=0.0)
        logger.info(
            "transfer %s: %s loaded %d tokens in %.1f ms (claim %.1f, pull %.1f [transport %.1f], confirm %.1f)",
            rec.transfer_id,
            rec.req_id,
            rec.num_tokens,
            (now - rec.started_at) * 1e3,
            (claimed - rec.started_at) * 1e3,
            max(pulled - pull_from, 0.0) * 1e3,
            pull_s * 1e3,
            max(now - max(claimed, pulled), 0.0) * 1e3,
        )
        self._drop_recv(rec)
        self._new_done.append(RecvDone(rec.req_id, True))
        self._bump("recv_ok")
        self._bump("tokens_loaded", rec.num_tokens)

    def _fail(self, rec: _Recv, code: str, message: str, *, abort: bool) -> None:
        logger.warning("transfer %s: KV load for %s failed (%s): %s", rec.transfer_id, rec.req_id, code, message)
        self._drop_recv(rec)
        self._new_done.append(RecvDone(rec.req_id, False, rec.local_block_ids))
        self._count_failure(len(rec.local_block_ids))
        if abort:
            self._commands.append(Abort(rec.transfer_id, f"decode KV load failed: {code}: {message}"[:1000]))

    def _drop_recv(self, rec: _Recv) -> None:
        self._recv.pop(rec.req_id, None)
        self._recv_by_tid.pop(rec.transfer_id, None)

    def _count_failure(self, nblocks: int) -> None:
        self._bump("recv_failed")
        self._bump("invalid_blocks", nblocks)

    def _bump(self, name: str, by: int = 1) -> None:
        if by:
            self.counters[name] += by
            self.counters_version += 1

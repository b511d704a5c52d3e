"""The scheduler half's decode side: claim a handoff, have the workers pull it, report the load.

A request with `do_remote_prefill` in its `kv_transfer_params`:
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
  later), read held blocks. Past that bound, D waits for DONE, and a refusal with the record gone is a
  load error. The ledger stays the authority on where the KV is: the early plan is used only if the
  claimed record yields the very same plan.

The router's claim: when the router claimed the handoff for this very instance before sending the
request, and sealed the claim with the key both derive from the metaserver's admin token
(`KVTransferParams.trusted_until`, `pdgate.claim_seal`: a client reaching vLLM directly cannot
forge one and point us at another request's blocks), there is no Claim round trip at all. The record
was CLAIMED for us at the ledger's time t_c, before the request left the router, so the
argument above holds from t_c: a pull that finished before `trusted_until` (half the claim lease after
t_c, on the wall clock) read held blocks. The RecvPlan carries that bound, and each worker reports such a
pull finished in the very step it completes (`PullOutcome.reported`), so vLLM schedules the request's
first forward in the next step; DONE goes out afterwards, off the path. A pull that ended past the bound
is confirmed by DONE first, like any late pull; a claim made for another instance, or a location hint
that cannot be used, takes the ordinary path (our Claim of a record the router claimed for us renews it).

The synchronous load of an idle engine (`decode_load.py` says when and why) pulls in the step that
computes the first token. The rules above still hold: the pull must end within the router's claim, or
the load fails (its blocks as load errors in that same step, so vLLM drops the token and fails or
recomputes the request); DONE goes out once the pull is known, off the path.

Siblings (vLLM's n > 1) share one claim and one end (DONE after the last one settled): `siblings.py`.
The loads in progress, and the bookkeeping every end shares (report, settle, count, log): `decode_recv.py`.

Pure bookkeeping like the rest of the scheduler half: `now` is an argument, I/O leaves as commands.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdgate.connector.blocks import tokens_to_load
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.decode_load import blocks_to_fill, may_load_sync, read_decode_params, same_prompt
from pdgate.connector.decode_recv import Loads, Recv, RecvState
from pdgate.connector.errors import LocationError
from pdgate.connector.layerwise import layer_counts
from pdgate.connector.location import EngineFacts, plan_for, plan_from_location
from pdgate.connector.logs import about
from pdgate.connector.messages import Claim, Claimed, ClaimFailed, DoneResult
from pdgate.connector.metadata import PullOutcome, RecvDone, RecvPlan
from pdgate.connector.outbox import Outbox
from pdgate.connector.siblings import Share, Siblings

from pdgate import claim_seal
from pdgate.contract import InvalidTransferParams, KVTransferParams
from pdgate.errors import Code
from pdgate.models import Handoff

__all__ = ["DecodeSide"]

logger = logging.getLogger(__name__)

# A synchronous load is heard of in the step that computed its first token; its DONE (and log line) wait
# this long, a step or two, because the control thread sending DONE takes the engine core's GIL from the
# thread that sends that token out (measured: ~2 ms more from the step's end to the API server).
_SETTLE_AFTER_S = 0.003

# A claim that failed for one of these left nothing to abort: the record is terminal or unknown.
# A claim refused for one of these leaves nothing of ours to abort: the handoff is gone, or another decode
# holds it (ILLEGAL_TRANSITION, pdgate/claim_wait.py) and aborting would free the KV that decode reads.
_NOTHING_TO_ABORT = frozenset({Code.HANDOFF_TERMINAL, Code.HANDOFF_NOT_FOUND, Code.NOT_FOUND, Code.ILLEGAL_TRANSITION})


class DecodeSide:
    """See the module docstring. One per scheduler half; engine-core thread only."""

    def __init__(self, cfg: ConnectorConfig, facts: EngineFacts, out: Outbox) -> None:
        self._cfg = cfg
        self._facts = facts
        self._out = out
        self._claim_key = claim_seal.claim_key(cfg.metaserver_token)  # None: no router claim is trusted
        self._siblings = Siblings(out)  # what the requests loading one handoff share, until DONE/abort
        self._loads = Loads(out, self._siblings, facts.world_size)  # the pulls in progress, and their ends
        self._consumed: set[str] = set()  # req ids whose handoff was set up or released
        self._new_pulls: list[RecvPlan] = []
        # req id -> its local (block-aligned) hit, for the requests last answered "load synchronously"
        self._sync: dict[str, int] = {}
        self._prompt_checked: dict[str, bool] = {}  # req id -> `same_prompt`, until its allocation
        self._settle_next: list[Recv] = []  # synchronous loads pulled, to settle at the next step

    # ---- vLLM hooks ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, *, alone: bool = False
    ) -> tuple[int, bool]:
        """How many prompt tokens this request will load, and whether asynchronously. `alone`: the engine
        has no other request, so a synchronous load holds nobody up (module doc). The only state it
        keeps is that last answer per request, for `update_state_after_alloc`."""
        req_id = request.request_id
        self._sync.pop(req_id, None)
        if req_id in self._consumed:
            return 0, False
        try:
            kv: KVTransferParams | None = read_decode_params(request.kv_transfer_params)
        except InvalidTransferParams:
            # Still take the async path: the load then fails visibly (load errors) instead of the
            # request silently being prefilled here.
            kv = None
        remote_num_tokens = kv.remote_num_tokens if kv is not None else None
        count = tokens_to_load(request.num_prompt_tokens, remote_num_tokens, num_computed_tokens)
        if count <= 0:
            return 0, False
        if kv is not None and not self._prompt_ok(req_id, request, kv):
            return 0, False  # released at allocation (`update_state_after_alloc`)
        # Synchronous when vLLM then computes just the last prompt token in the allocation step: the
        # prefill covers the whole prompt (load all but that token) or all but its last token (a prompt
        # that ends with the prefill's first token, `pdgate.router.first_token`: load all it covers).
        last = request.num_prompt_tokens - 1
        to_last = min(count, last - num_computed_tokens)
        reaches = num_computed_tokens + count >= last
        if alone and to_last > 0 and kv is not None and self._may_load_sync(kv, reaches):
            self._sync[req_id] = num_computed_tokens
            return to_last, False
        return count, True

    def _prompt_ok(self, req_id: str, request: Any, kv: KVTransferParams) -> bool:
        """`same_prompt`, worked out once per request (vLLM asks again on every scheduling attempt)."""
        ok = self._prompt_checked.get(req_id)
        if ok is None:
            ok = self._prompt_checked[req_id] = same_prompt(request.prompt_token_ids, kv)
        return ok

    def _may_load_sync(self, kv: KVTransferParams, whole_prompt: bool) -> bool:
        return may_load_sync(
            self._cfg, kv, instance_id=self._facts.instance_id, claim_key=self._claim_key, whole_prompt=whole_prompt
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, *, now: float) -> None:
        """vLLM allocated the request's blocks: release its handoff when it loads nothing (`_release`),
        else start its load: an early pull from the params' location (`_plan_early`), then its claim
        (`_claim`: the router's, its own, or a sibling's)."""
        req_id = request.request_id
        if req_id in self._consumed:
            return
        self._consumed.add(req_id)
        kv: KVTransferParams | None
        try:
            kv = read_decode_params(request.kv_transfer_params)
        except InvalidTransferParams as exc:
            self._out.bump("bad_params")
            logger.error("request %s: %s", req_id, exc)
            kv = None
        local_hit = self._sync.pop(req_id, None)
        prompt_ok = self._prompt_checked.pop(req_id, True)
        if num_external_tokens <= 0:
            if kv is not None:
                self._release(req_id, kv, prompt_ok)
            return
        group = blocks.blocks[0] if blocks.blocks else ()
        sync = local_hit is not None
        hit, local = blocks_to_fill(group, num_external_tokens, self._facts.block_size, local_hit)
        self._out.bump("recv_started")
        if kv is None or self._too_late(req_id, kv.require_transfer_id()):
            self._loads.fail_unstarted(req_id, local, sync=sync)
            return
        transfer_id = kv.require_transfer_id()
        share, first = self._siblings.join(transfer_id, kv.siblings or 1)
        deadline = now + self._cfg.ready_wait_s + self._cfg.pull_timeout_s + self._cfg.free_margin_s
        rec = Recv(req_id, transfer_id, local, hit, num_external_tokens, deadline, sync=sync, started_at=now)
        self._loads.add(rec)
        trusted_until = kv.trusted_until(self._facts.instance_id, self._claim_key)
        if trusted_until is None and kv.claimed_by == self._facts.instance_id:
            self._out.bump("claims_untrusted")  # unsealed, forged, or under another token: we claim ourselves
        if self._plan_early(rec, kv, trusted_until, now):
            self._claim(rec, kv, share, first=first, trusted_until=trusted_until, now=now)

    def _too_late(self, req_id: str, transfer_id: str) -> bool:
        """Whether the request carries a handoff whose siblings' DONE already went out: too late to join."""
        if self._siblings.get(transfer_id) is not None or not self._loads.members(transfer_id):
            return False
        logger.error(
            "transfer %s: a decode request (%s) carries it after its siblings finished; failing it",
            transfer_id,
            req_id,
            extra=about(transfer_id),
        )
        return True

    def _plan_early(self, rec: Recv, kv: KVTransferParams, trusted_until: float | None, now: float) -> bool:
        """Start the pull from the params' location (the prefill's copy of its READY record) before any
        claim answers; under the router's claim the plan carries its bound. False: the load failed (a
        synchronous load has no claim to wait for)."""
        location = kv.location()
        if location is None or kv.kv_key is None:
            return True
        try:
            plan = plan_for(
                location,
                self._facts,
                transfer_id=rec.transfer_id,
                kv_key=kv.kv_key,
                req_id=rec.req_id,
                local_block_ids=rec.local_block_ids,
                hit_blocks=rec.hit_blocks,
            )
        except LocationError as exc:
            if rec.sync:  # vLLM computes it in this step: no claim can come in time, the load fails now
                self._loads.fail(rec, exc.code, exc.message, abort=True)
                return False
            # Only a hint: the claimed record decides (and fails the load if it is this same location).
            logger.debug(
                "transfer %s: no early pull (%s): %s",
                rec.transfer_id,
                exc.code.value,
                exc.message,
                extra=about(rec.transfer_id),
            )
            return True
        if trusted_until is not None:
            plan = replace(plan, trusted_until=trusted_until, sync=rec.sync)
        rec.early = plan
        rec.state = RecvState.PULLING
        rec.pull_started_at = now
        self._new_pulls.append(plan)
        return True

    def _claim(
        self, rec: Recv, kv: KVTransferParams, share: Share, *, first: bool, trusted_until: float | None, now: float
    ) -> None:
        """Who claims `rec`'s handoff: the router did (no round trip), this request (the first sibling to
        load), or a sibling, whose claim is in flight or already answered."""
        if rec.early is not None and trusted_until is not None:
            # The router claimed it for us (module docstring): no round trip before the pull.
            rec.claimed = rec.by_router = True
            rec.claimed_at = now
            assert kv.claim_lease_s is not None
            rec.claim_lease_s = kv.claim_lease_s
            self._out.bump("claims_by_router")
            if rec.sync:
                self._out.bump("recv_sync")
        elif rec.sync:
            # Checked in get_num_new_matched_tokens; only a claim that stopped verifying since lands here.
            self._loads.fail(rec, Code.LOCATION_MISMATCH, "no usable router claim for a synchronous load", abort=True)
            return
        elif first:
            self._out.send(Claim(rec.transfer_id))
        elif share.claim_failed is not None:  # a sibling's claim already failed
            failed = share.claim_failed
            self._loads.fail(rec, failed.code, failed.message, abort=failed.code not in _NOTHING_TO_ABORT)
            return
        elif share.handoff is not None:  # a sibling's claim answered: pull where it says
            self._apply_claim(rec, share.handoff, now)
            return
        logger.debug(
            "transfer %s: decode %s %s, %d local blocks (%d cached)",
            rec.transfer_id,
            rec.req_id,
            "pulls under the router's claim" if rec.by_router else "claims",
            len(rec.local_block_ids),
            rec.hit_blocks,
            extra=about(rec.transfer_id),
        )

    def _release(self, req_id: str, kv: KVTransferParams, prompt_ok: bool) -> None:
        """A request that loads nothing: its prefix was cached here, or its prompt is not the one the
        prefill's KV belongs to (`same_prompt`: computed here instead). Released through its share, so a
        sibling that still reads the handoff keeps it (`siblings.py`); alone, the prefill frees at once."""
        transfer_id = kv.require_transfer_id()
        if prompt_ok:
            self._out.bump("recv_released")
            reason = "decode did not need the KV (local prefix cache hit)"
        else:
            self._out.bump("prompt_mismatch")
            logger.error(
                "transfer %s: decode %s's prompt does not start with the %s tokens the prefill's KV belongs "
                "to; released it, the prompt is computed here",
                transfer_id,
                req_id,
                kv.remote_num_tokens,
                extra=about(transfer_id),
            )
            reason = "the decode's prompt differs from the one the prefill computed"
        self._siblings.release(transfer_id, kv.siblings or 1, reason)

    def request_finished(self, request: Any, *, now: float) -> None:
        req_id = request.request_id
        self._prompt_checked.pop(req_id, None)
        self._settle_sync(now, req_id)  # its only step may have been its last (max_tokens 1)
        if req_id in self._consumed:
            # Set up (or released) already; an in-flight pull finishes on its own and vLLM keeps the
            # blocks until it is reported.
            self._consumed.discard(req_id)
            return
        # Finished before it was ever scheduled (aborted, rejected): tell the prefill to free now.
        try:
            kv = read_decode_params(request.kv_transfer_params)
        except InvalidTransferParams:
            self._out.bump("bad_params")
            return
        self._out.bump("recv_released")
        self._siblings.release(
            kv.require_transfer_id(), kv.siblings or 1, "decode request ended before its KV was pulled"
        )

    def on_worker_output(self, outcomes: Sequence[PullOutcome], *, now: float) -> None:
        """Per-rank pull outcomes (aggregated over the workers by vLLM, possibly over several steps)."""
        for oc in outcomes:
            if oc.layer_order is not None:
                for name, n in layer_counts(oc.layer_order).items():
                    self._out.bump(name, n)
            rec = self._loads.get(oc.req_id)
            if rec is None or rec.transfer_id != oc.transfer_id or rec.state is not RecvState.PULLING:
                continue  # a late outcome for a request already failed (deadline) or finished
            rec.outcomes[oc.tp_rank] = oc
            if oc.ok:
                self._out.bump("blocks_pulled", oc.nblocks)
                self._out.bump("bytes_pulled", oc.nbytes)
            else:
                self._out.bump("pulls_failed")
            if len(rec.outcomes) < self._facts.world_size:
                continue
            failed = [o for o in rec.outcomes.values() if not o.ok]
            if failed:
                first = failed[0]
                code = first.code or Code.TRANSPORT_ERROR
                self._loads.fail(rec, code, f"tp rank {first.tp_rank}: {first.message}", abort=True)
            else:
                rec.pulled_at = now
                if rec.sync:
                    # Heard of in the step that computed its first token: DONE (and the log line) wait a
                    # little (`_SETTLE_AFTER_S`), off that token's way out of the engine core.
                    rec.state = RecvState.PULLED
                    self._settle_next.append(rec)
                elif rec.by_router:
                    self._pulled_under_router_claim(rec, now)
                elif rec.claimed:
                    self._pulled_and_claimed(rec, now)
                else:
                    rec.state = RecvState.PULLED

    # ---- control-thread results ---------------------------------------------------------------------

    def on_claimed(self, result: Claimed, now: float) -> None:
        share = self._siblings.get(result.transfer_id)
        if share is not None:
            share.handoff = result.handoff
        for rec in self._loads.members(result.transfer_id):
            if not rec.claimed:
                self._apply_claim(rec, result.handoff, now)

    def on_claim_failed(self, result: ClaimFailed) -> None:
        self._out.bump("claims_failed")
        share = self._siblings.get(result.transfer_id)
        if share is not None:
            share.claim_failed = result
        for rec in self._loads.members(result.transfer_id):
            if not rec.claimed:
                self._loads.fail(rec, result.code, result.message, abort=result.code not in _NOTHING_TO_ABORT)

    def on_done(self, result: DoneResult, now: float) -> None:
        if result.code is not None:
            # Refused while the KV was still held (a lapsed claim): should never happen. Refused because
            # the handoff had already ended (the router aborted it: its client went away) is the race
            # that abort is for, counted apart.
            self._out.bump("done_refused" if result.valid else "done_after_end")
        for rec in self._loads.members(result.transfer_id):
            if rec.state is not RecvState.CONFIRMING:
                continue
            if result.valid:
                self._loads.complete_ok(rec, now)
            else:
                code = result.code or Code.INTERNAL
                self._loads.fail(rec, code, result.message or "", abort=code is not Code.HANDOFF_TERMINAL)

    # ---- per step -----------------------------------------------------------------------------------

    def take_step(self, now: float) -> tuple[tuple[RecvPlan, ...], tuple[RecvDone, ...]]:
        """Settle the synchronous loads of the step before, fail the loads past their deadline, then hand
        over the new pulls and the finished loads."""
        self._settle_sync(now)
        for rec in self._loads.all():
            if now >= rec.deadline:
                self._loads.fail(
                    rec, Code.KV_LOAD_TIMEOUT, f"KV load still {rec.state.value} at its deadline", abort=True
                )
        pulls, done = tuple(self._new_pulls), tuple(self._loads.take_done())
        self._new_pulls = []
        return pulls, done

    def _settle_sync(self, now: float, req_id: str | None = None) -> None:
        """The synchronous loads pulled `_SETTLE_AFTER_S` ago or more (or `req_id`'s, which ended): DONE
        goes out now."""
        keep = []
        for rec in self._settle_next:
            if rec.req_id == req_id or (req_id is None and now - (rec.pulled_at or 0.0) >= _SETTLE_AFTER_S):
                self._pulled_under_router_claim(rec, now)
            else:
                keep.append(rec)
        self._settle_next = keep

    @property
    def loading(self) -> int:
        """Requests whose KV load is in progress."""
        return len(self._loads)

    def claim_latency_ms(self) -> list[float]:
        """The claim latency of the latest loads (ms, oldest first), for the stats snapshot."""
        return self._loads.claim_latency_ms()

    # ---- internals ----------------------------------------------------------------------------------

    def _apply_claim(self, rec: Recv, handoff: Handoff, now: float) -> None:
        """The ledger's claimed record for `rec`: pull where it says, or check the early pull against it."""
        rec.claimed_at = now
        try:
            plan = plan_from_location(
                handoff,
                self._facts,
                req_id=rec.req_id,
                local_block_ids=rec.local_block_ids,
                hit_blocks=rec.hit_blocks,
            )
        except LocationError as exc:
            self._loads.fail(rec, exc.code, exc.message, abort=True)
            return
        rec.claimed = True
        rec.claim_lease_s = handoff.lease_s
        if rec.early is None:
            rec.state = RecvState.PULLING
            rec.pull_started_at = now
            self._new_pulls.append(plan)
            return
        if plan != rec.early:
            self._loads.fail(
                rec,
                Code.LOCATION_MISMATCH,
                "the ledger's KV location differs from the one in kv_transfer_params (pulled from the latter)",
                abort=True,
            )
            return
        if rec.state is RecvState.PULLED:
            self._pulled_and_claimed(rec, now)

    def _pulled_under_router_claim(self, rec: Recv, now: float) -> None:
        """Every rank pulled. Those that finished within the router's claim already reported the request
        (same step); DONE goes out now (after the last sibling), off the path. A rank past the bound waits
        for DONE (see top)."""
        self._loads.settle(rec, ok=True)
        if self._loads.unreported(rec):
            rec.state = RecvState.CONFIRMING
        else:
            self._loads.complete_ok(rec, now)

    def _pulled_and_claimed(self, rec: Recv, now: float) -> None:
        """Report the load now if the pull ended within the claim lease; else wait for DONE (see top)."""
        self._loads.settle(rec, ok=True)
        # Half the lease: room for the metaserver's clock running at another rate than ours.
        if now - rec.started_at < rec.claim_lease_s / 2:
            self._loads.complete_ok(rec, now)
        else:
            rec.state = RecvState.CONFIRMING

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

Pure bookkeeping like the rest of the scheduler half: `now` is an argument, I/O leaves as commands.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdgate.connector.blocks import tokens_to_load
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.decode_load import blocks_to_fill, may_load_sync, read_decode_params, same_prompt
from pdgate.connector.decode_recv import Recv, RecvState, reported
from pdgate.connector.errors import LocationError
from pdgate.connector.location import EngineFacts, plan_for, plan_from_location
from pdgate.connector.logs import about
from pdgate.connector.messages import Abort, Claim, Claimed, ClaimFailed, DoneResult
from pdgate.connector.metadata import PullOutcome, RecvDone, RecvPlan
from pdgate.connector.outbox import Outbox
from pdgate.connector.siblings import Siblings

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
_CLAIM_SAMPLES = 4096  # the latest claim latencies kept for the stats snapshot

# A claim that failed for one of these left nothing to abort: the record is terminal or unknown.
_NOTHING_TO_ABORT = frozenset({Code.HANDOFF_TERMINAL, Code.HANDOFF_NOT_FOUND, Code.NOT_FOUND})


class DecodeSide:
    """See the module docstring. One per scheduler half; engine-core thread only."""

    def __init__(self, cfg: ConnectorConfig, facts: EngineFacts, out: Outbox) -> None:
        self._cfg = cfg
        self._facts = facts
        self._out = out
        self._claim_key = claim_seal.claim_key(cfg.metaserver_token)  # None: no router claim is trusted
        self._recv: dict[str, Recv] = {}  # req_id -> pull in progress
        self._recv_by_transfer: dict[str, list[str]] = {}  # transfer_id -> req ids loading it
        self._siblings = Siblings(out)  # what the requests loading one handoff share, until DONE/abort
        self._consumed: set[str] = set()  # req ids whose handoff was set up or released
        self._new_pulls: list[RecvPlan] = []
        self._new_done: list[RecvDone] = []
        # req id -> its local (block-aligned) hit, for the requests last answered "load synchronously"
        self._sync: dict[str, int] = {}
        self._prompt_checked: dict[str, bool] = {}  # req id -> `same_prompt`, until its allocation
        self._settle_next: list[Recv] = []  # synchronous loads pulled, to settle at the next step
        # Claim latency (ms) of the latest loads, from allocation to the claim in hand (0 for the router's).
        self._claim_ms: deque[float] = deque(maxlen=_CLAIM_SAMPLES)

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
        if kv is None:
            self._fail_unstarted(req_id, local, sync=sync)
            return
        transfer_id = kv.require_transfer_id()
        if self._siblings.get(transfer_id) is None and transfer_id in self._recv_by_transfer:
            # Its siblings' DONE already went out: too late to join.
            logger.error(
                "transfer %s: a decode request (%s) carries it after its siblings finished; failing it",
                transfer_id,
                req_id,
                extra=about(transfer_id),
            )
            self._fail_unstarted(req_id, local, sync=sync)
            return
        share, first = self._siblings.join(transfer_id, kv.siblings or 1)
        deadline = now + self._cfg.ready_wait_s + self._cfg.pull_timeout_s + self._cfg.free_margin_s
        rec = Recv(req_id, transfer_id, local, hit, num_external_tokens, deadline, sync=sync, started_at=now)
        self._recv[req_id] = rec
        self._recv_by_transfer.setdefault(transfer_id, []).append(req_id)
        trusted_until = kv.trusted_until(self._facts.instance_id, self._claim_key)
        if trusted_until is None and kv.claimed_by == self._facts.instance_id:
            self._out.bump("claims_untrusted")  # unsealed, forged, or under another token: we claim ourselves
        location = kv.location()
        if location is not None and kv.kv_key is not None:
            try:
                rec.early = plan_for(
                    location,
                    self._facts,
                    transfer_id=transfer_id,
                    kv_key=kv.kv_key,
                    req_id=req_id,
                    local_block_ids=local,
                    hit_blocks=hit,
                )
                if trusted_until is not None:
                    rec.early = replace(rec.early, trusted_until=trusted_until, sync=sync)
            except LocationError as exc:
                if sync:  # vLLM computes it in this step: no claim can come in time, the load fails now
                    self._fail(rec, exc.code, exc.message, abort=True)
                    return
                # Only a hint: the claimed record decides (and fails the load if it is this same location).
                logger.debug(
                    "transfer %s: no early pull (%s): %s",
                    transfer_id,
                    exc.code.value,
                    exc.message,
                    extra=about(transfer_id),
                )
            else:
                rec.state = RecvState.PULLING
                rec.pull_started_at = now
                self._new_pulls.append(rec.early)
        if rec.early is not None and trusted_until is not None:
            # The router claimed it for us (module docstring): no round trip before the pull.
            rec.claimed = rec.by_router = True
            rec.claimed_at = now
            assert kv.claim_lease_s is not None
            rec.claim_lease_s = kv.claim_lease_s
            self._out.bump("claims_by_router")
            if sync:
                self._out.bump("recv_sync")
        elif sync:
            # Checked in get_num_new_matched_tokens; only a claim that stopped verifying since lands here.
            self._fail(rec, Code.LOCATION_MISMATCH, "no usable router claim for a synchronous load", abort=True)
            return
        elif first:
            self._out.send(Claim(transfer_id))
        elif share.claim_failed is not None:  # a sibling's claim already failed
            failed = share.claim_failed
            self._fail(rec, failed.code, failed.message, abort=failed.code not in _NOTHING_TO_ABORT)
            return
        elif share.handoff is not None:  # a sibling's claim answered: pull where it says
            self._apply_claim(rec, share.handoff, now)
            return
        logger.debug(
            "transfer %s: decode %s %s, %d local blocks (%d cached)",
            transfer_id,
            req_id,
            "pulls under the router's claim" if rec.by_router else "claims",
            len(local),
            hit,
            extra=about(transfer_id),
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
            rec = self._recv.get(oc.req_id)
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
                self._fail(rec, code, f"tp rank {first.tp_rank}: {first.message}", abort=True)
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
        for rec in self._members(result.transfer_id):
            if not rec.claimed:
                self._apply_claim(rec, result.handoff, now)

    def on_claim_failed(self, result: ClaimFailed) -> None:
        self._out.bump("claims_failed")
        share = self._siblings.get(result.transfer_id)
        if share is not None:
            share.claim_failed = result
        for rec in self._members(result.transfer_id):
            if not rec.claimed:
                self._fail(rec, result.code, result.message, abort=result.code not in _NOTHING_TO_ABORT)

    def on_done(self, result: DoneResult, now: float) -> None:
        if result.code is not None:
            # Refused while the KV was still held (a lapsed claim): should never happen. Refused because
            # the handoff had already ended (the router aborted it: its client went away) is the race
            # that abort is for, counted apart.
            self._out.bump("done_refused" if result.valid else "done_after_end")
        for rec in self._members(result.transfer_id):
            if rec.state is not RecvState.CONFIRMING:
                continue
            if result.valid:
                self._complete_ok(rec, now)
            else:
                code = result.code or Code.INTERNAL
                self._fail(rec, code, result.message or "", abort=code is not Code.HANDOFF_TERMINAL)

    # ---- per step -----------------------------------------------------------------------------------

    def take_step(self, now: float) -> tuple[tuple[RecvPlan, ...], tuple[RecvDone, ...]]:
        """Settle the synchronous loads of the step before, fail the loads past their deadline, then hand
        over the new pulls and the finished loads."""
        self._settle_sync(now)
        for rec in list(self._recv.values()):
            if now >= rec.deadline:
                self._fail(rec, Code.KV_LOAD_TIMEOUT, f"KV load still {rec.state.value} at its deadline", abort=True)
        pulls, done = tuple(self._new_pulls), tuple(self._new_done)
        self._new_pulls, self._new_done = [], []
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
        return len(self._recv)

    # ---- internals ----------------------------------------------------------------------------------

    def _members(self, transfer_id: str) -> list[Recv]:
        """The requests loading `transfer_id` (siblings, or the one request)."""
        return [self._recv[r] for r in self._recv_by_transfer.get(transfer_id, ()) if r in self._recv]

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
            self._fail(rec, exc.code, exc.message, abort=True)
            return
        rec.claimed = True
        rec.claim_lease_s = handoff.lease_s
        if rec.early is None:
            rec.state = RecvState.PULLING
            rec.pull_started_at = now
            self._new_pulls.append(plan)
            return
        if plan != rec.early:
            self._fail(
                rec,
                Code.LOCATION_MISMATCH,
                "the ledger's KV location differs from the one in kv_transfer_params (pulled from the latter)",
                abort=True,
            )
            return
        if rec.state is RecvState.PULLED:
            self._pulled_and_claimed(rec, now)

    def _settle(self, rec: Recv, *, ok: bool, abort: str | None = None) -> None:
        """`rec` pulled (`ok`) or failed; once every sibling did, DONE (any pulled) or the abort goes out."""
        if not rec.settled and self._siblings.settle(rec.transfer_id, ok=ok, abort=abort):
            rec.settled = True
            return
        if abort is not None and not ok:  # its DONE went out and failed: give the handoff up
            self._out.send(Abort(rec.transfer_id, abort))

    def claim_latency_ms(self) -> list[float]:
        """The claim latency of the latest loads (ms, oldest first), for the stats snapshot."""
        return list(self._claim_ms)

    def _unreported(self, rec: Recv) -> frozenset[int] | None:
        """The TP ranks that still need a RecvDone (None: all): under the router's claim a worker may have
        reported the request itself."""
        if not rec.by_router:
            return None
        return frozenset(r for r in range(self._facts.world_size) if not reported(rec.outcomes.get(r)))

    def _pulled_under_router_claim(self, rec: Recv, now: float) -> None:
        """Every rank pulled. Those that finished within the router's claim already reported the request
        (same step); DONE goes out now (after the last sibling), off the path. A rank past the bound waits
        for DONE (see top)."""
        self._settle(rec, ok=True)
        if self._unreported(rec):
            rec.state = RecvState.CONFIRMING
        else:
            self._complete_ok(rec, now)

    def _pulled_and_claimed(self, rec: Recv, now: float) -> None:
        """Report the load now if the pull ended within the claim lease; else wait for DONE (see top)."""
        self._settle(rec, ok=True)
        # Half the lease: room for the metaserver's clock running at another rate than ours.
        if now - rec.started_at < rec.claim_lease_s / 2:
            self._complete_ok(rec, now)
        else:
            rec.state = RecvState.CONFIRMING

    def _complete_ok(self, rec: Recv, now: float) -> None:
        # claim: until the claim's answer; pull: from the plan to every worker's outcome (it overlaps the
        # claim when it started early); confirm: from the later of the two to the report.
        claimed = rec.claimed_at if rec.claimed_at is not None else now
        pulled = rec.pulled_at if rec.pulled_at is not None else now
        pull_from = rec.pull_started_at if rec.pull_started_at is not None else claimed
        pull_s = max((o.elapsed_s for o in rec.outcomes.values()), default=0.0)
        self._claim_ms.append((claimed - rec.started_at) * 1e3)
        if rec.sync:
            # Heard of after the forward it fed: the pull's share of the path is what the step waited.
            waited = max((o.waited_s for o in rec.outcomes.values()), default=0.0)
            total, pull, confirm = waited, waited, 0.0
        else:
            total, pull = now - rec.started_at, max(pulled - pull_from, 0.0)
            confirm = max(now - max(claimed, pulled), 0.0)
        logger.info(
            "transfer %s: %s loaded %d tokens in %.1f ms (claim %.1f, pull %.1f [transport %.1f], confirm %.1f)%s",
            rec.transfer_id,
            rec.req_id,
            rec.num_tokens,
            total * 1e3,
            (claimed - rec.started_at) * 1e3,
            pull * 1e3,
            pull_s * 1e3,
            confirm * 1e3,
            (" under the router's claim" if rec.by_router else "") + (", synchronously" if rec.sync else ""),
            extra=about(rec.transfer_id),
        )
        self._drop(rec)
        ranks = self._unreported(rec)
        if ranks is None or ranks:
            self._new_done.append(RecvDone(rec.req_id, True, ranks=ranks))
        self._out.bump("recv_ok")
        self._out.bump("tokens_loaded", rec.num_tokens)

    def _fail(self, rec: Recv, code: Code, message: str, *, abort: bool) -> None:
        logger.warning(
            "transfer %s: KV load for %s failed (%s): %s",
            rec.transfer_id,
            rec.req_id,
            code.value,
            message,
            extra=about(rec.transfer_id),
        )
        self._drop(rec)
        ranks = self._unreported(rec)
        if ranks is None or ranks:
            self._new_done.append(RecvDone(rec.req_id, False, rec.local_block_ids, ranks=ranks, sync=rec.sync))
        self._count_failure(len(rec.local_block_ids))
        self._settle(rec, ok=False, abort=f"decode KV load failed: {code.value}: {message}"[:1000] if abort else None)

    def _fail_unstarted(self, req_id: str, local: tuple[int, ...], *, sync: bool = False) -> None:
        self._new_done.append(RecvDone(req_id, False, local, sync=sync))
        self._count_failure(len(local))

    def _drop(self, rec: Recv) -> None:
        self._recv.pop(rec.req_id, None)
        members = self._recv_by_transfer.get(rec.transfer_id)
        if members is not None:
            if rec.req_id in members:
                members.remove(rec.req_id)
            if not members:
                del self._recv_by_transfer[rec.transfer_id]

    def _count_failure(self, nblocks: int) -> None:
        self._out.bump("recv_failed")
        self._out.bump("invalid_blocks", nblocks)

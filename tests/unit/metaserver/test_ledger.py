"""The pure state machine: every rule with an explicit `now`, no store, no sockets."""

from __future__ import annotations

import pytest
from pdgate.metaserver import ledger
from pdgate.metaserver.ledger import ALLOWED, LAPSES, MOVES, IllegalTransition

from pdgate.models import TERMINAL_STATES, Handoff, HandoffCreate, HandoffState, KVLocation

S = HandoffState
LOC = KVLocation(block_ids=[[1, 2]], num_tokens=20)


def new(now: float = 100.0, lease_s: float | None = None) -> Handoff:
    body = HandoffCreate(prefill_instance_id="p0", lease_s=lease_s)
    return ledger.create(body, transfer_id="t", kv_key=7, now=now, pending_lease_s=60, ready_lease_s=30)


def test_table_terminal_states_lead_nowhere_and_live_ones_can_end() -> None:
    for state in TERMINAL_STATES:
        assert ALLOWED[state] == frozenset()
    for state in (S.PENDING, S.READY, S.CLAIMED):
        assert {S.ABORTED, S.EXPIRED} <= ALLOWED[state]
    assert set(ALLOWED) == set(S)


def test_caller_moves_leave_only_their_sources() -> None:
    assert MOVES["ready"].sources == {S.PENDING}
    assert MOVES["claim"].sources == {S.READY}
    assert MOVES["done"].sources == {S.CLAIMED} and MOVES["done"].lapsed_sources == {S.READY}
    assert MOVES["abort"].sources == MOVES["expire"].sources == {S.PENDING, S.READY, S.CLAIMED}
    assert LAPSES == ("requeue", "expire") and MOVES["requeue"].sources == {S.CLAIMED}


def test_only_terminal_moves_end_the_lease() -> None:
    for move in MOVES.values():
        assert (move.lease is ledger.Lease.NONE) == (move.to in TERMINAL_STATES)


def test_create_uses_the_pending_lease_and_keeps_the_ready_lease() -> None:
    rec = new(lease_s=5)
    assert rec.state is S.PENDING and rec.deadline == 160 and rec.lease_s == 5 and rec.kv_key == 7
    assert new().lease_s == 30


def test_apply_is_pure_and_checks_the_table() -> None:
    rec = new()
    moved = ledger.apply(MOVES["ready"], rec, now=101, value=LOC)
    assert rec.state is S.PENDING  # the input is untouched
    assert (moved.state, moved.deadline, moved.updated_at) == (S.READY, 131, 101)
    with pytest.raises(IllegalTransition) as err:
        ledger.apply(MOVES["done"], rec, now=101)
    assert err.value.current is S.PENDING and err.value.to is S.DONE and not err.value.terminal
    assert err.value.code == "illegal_transition"
    with pytest.raises(ValueError):
        ledger.apply(MOVES["claim"], moved, now=101, caller="d0")  # a claim needs the caller's lease


def test_a_refusal_from_a_terminal_record_has_the_terminal_code() -> None:
    rec = ledger.abort(new(), "x", now=101)
    with pytest.raises(IllegalTransition) as err:
        ledger.mark_ready(rec, LOC, now=102)
    assert err.value.terminal and err.value.code == "handoff_terminal" and err.value.status == 410


def test_happy_path_deadlines() -> None:
    rec = ledger.mark_ready(new(lease_s=5), LOC, now=110)
    assert rec.deadline == 115 and rec.location == LOC
    rec = ledger.claim(rec, "d0", now=111, lease_s=2)
    assert (rec.state, rec.decode_instance_id, rec.claims, rec.deadline) == (S.CLAIMED, "d0", 1, 113)
    rec = ledger.done(rec, "d0", now=112)
    assert rec.state is S.DONE and rec.deadline is None
    with pytest.raises(IllegalTransition) as err:
        ledger.abort(rec, "late", now=113)
    assert err.value.terminal and err.value.current is S.DONE


def test_mark_ready_only_from_pending() -> None:
    claimed = ledger.claim(ledger.mark_ready(new(), LOC, now=101), "d0", now=102, lease_s=5)
    with pytest.raises(IllegalTransition) as err:
        ledger.mark_ready(claimed, LOC, now=103)
    assert err.value.current is S.CLAIMED


def test_claim_is_exclusive_and_idempotent_for_the_claimant() -> None:
    rec = ledger.claim(ledger.mark_ready(new(), LOC, now=101), "d0", now=102, lease_s=5)
    again = ledger.claim(rec, "d0", now=104, lease_s=5)
    assert again.claims == 1 and again.deadline == 109
    with pytest.raises(IllegalTransition) as err:
        ledger.claim(rec, "d1", now=104, lease_s=5)
    assert "d0" in err.value.detail and err.value.current is S.CLAIMED


def test_done_checks_the_claimant_when_named() -> None:
    rec = ledger.claim(ledger.mark_ready(new(), LOC, now=101), "d0", now=102, lease_s=5)
    with pytest.raises(IllegalTransition) as err:
        ledger.done(rec, "d1", now=103)
    assert err.value.detail == "handoff is claimed by d0, not d1"
    assert ledger.done(rec, None, now=103).state is S.DONE


def test_lapse_nothing_due() -> None:
    rec = new()
    assert ledger.lapse(rec, now=159.9, max_claims=3) is None
    done = ledger.abort(rec, "x", now=101)
    assert ledger.lapse(done, now=1e9, max_claims=3) is None


def test_lapse_expires_pending_and_ready() -> None:
    expired = ledger.lapse(new(), now=160, max_claims=3)
    assert expired is not None and expired.state is S.EXPIRED and expired.reason == "PENDING lease lapsed"
    ready = ledger.mark_ready(new(), LOC, now=101)
    expired = ledger.lapse(ready, now=131, max_claims=3)
    assert expired is not None and expired.state is S.EXPIRED and expired.deadline is None


def test_lapsed_claim_goes_back_to_ready_until_max_claims() -> None:
    rec = ledger.claim(ledger.mark_ready(new(), LOC, now=101), "d0", now=102, lease_s=5)
    back = ledger.lapse(rec, now=107, max_claims=2)
    assert back is not None and back.state is S.READY and back.decode_instance_id == "d0" and back.deadline == 137
    late = ledger.done(back, "d0", now=107.5)  # the lapsed claimant's DONE still lands
    assert late.state is S.DONE and late.deadline is None
    for caller in (None, "d1"):
        with pytest.raises(ledger.IllegalTransition):
            ledger.done(back, caller, now=107.5)
    rec = ledger.claim(back, "d1", now=108, lease_s=5)
    assert rec.claims == 2
    final = ledger.lapse(rec, now=113, max_claims=2)
    assert final is not None and final.state is S.EXPIRED and final.reason == "CLAIMED lease lapsed"


def test_event_for_a_terminal_record() -> None:
    rec = ledger.abort(new(), "client gone", now=101)
    ev = ledger.event_for(rec)
    assert (ev.transfer_id, ev.kv_key, ev.state, ev.reason, ev.at) == ("t", 7, S.ABORTED, "client gone", 101)


@pytest.mark.parametrize(
    ("engine", "engine_id", "registered", "rule"),
    [
        (None, None, None, None),
        ("p0", None, "eng-p0", None),  # its own engine token, no engine_id stated
        ("p1", None, None, "engine"),  # another instance's engine token
        ("p1", "eng-x", "eng-p0", "engine"),  # the engine rule is checked first
        (None, "eng-p0", "eng-p0", None),
        (None, "eng-x", "eng-p0", "engine_id"),
        (None, "eng-x", None, None),  # the prefill not registered, or registered without an engine_id
        (None, "eng-x", "", "engine_id"),  # an empty engine_id is a value, not "none"
        (None, "", "eng-p0", "engine_id"),
    ],
)
def test_ready_only_by_the_handoffs_own_prefill(
    engine: str | None, engine_id: str | None, registered: str | None, rule: str | None
) -> None:
    if rule is None:
        ledger.check_ready("p0", engine=engine, engine_id=engine_id, registered=registered)
        return
    with pytest.raises(ledger.NotItsPrefill) as refused:
        ledger.check_ready("p0", engine=engine, engine_id=engine_id, registered=registered)
    assert (refused.value.rule, refused.value.prefill_instance_id) == (rule, "p0")
    assert refused.value.status == (403 if rule == "engine" else 422)
    assert refused.value.registered == (registered if rule == "engine_id" else None)

"""The store contract, ledger moves: one suite, run against the memory store and a real redis-server.

Time is passed explicitly (`now`), so nothing here sleeps. The rules come from `ledger.MOVES`; these
tests hold both interpreters (`ledger.apply` in the memory store, `_lib.lua` in the Redis store) to them.
"""

from __future__ import annotations

import asyncio

import pytest
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.store import Store

from pdgate.models import HandoffState
from tests.contract.conftest import MakeStore
from tests.contract.records import LOC, PENDING_LEASE, READY_LEASE, S, claimed, create, t0


async def test_create_is_pending_with_unique_increasing_kv_keys(store: Store) -> None:
    now = t0()
    a = await create(store, "a", now)
    b = await create(store, "b", now, lease_s=7.0)
    assert a.state is S.PENDING and a.prefill_instance_id == "p0" and a.request_id == "req-a"
    assert a.deadline == pytest.approx(now + PENDING_LEASE, abs=1e-3)
    assert a.lease_s == READY_LEASE and b.lease_s == 7.0
    assert 1 <= a.kv_key < b.kv_key < 2**63
    assert (await store.get_handoff("a")) == a.model_copy(update={"deadline": (await store.get_handoff("a")).deadline})


async def test_kv_keys_never_repeat_across_many_creates(store: Store) -> None:
    now = t0()
    recs = await asyncio.gather(*(create(store, f"k{i}", now) for i in range(200)))
    keys = [r.kv_key for r in recs]
    assert len(set(keys)) == 200


async def test_duplicate_transfer_id_is_refused_and_keeps_the_record(store: Store) -> None:
    now = t0()
    first = await create(store, "dup", now)
    with pytest.raises(HandoffExists) as err:
        await create(store, "dup", now + 1, prefill="other")
    assert err.value.current_state is S.PENDING
    again = await store.get_handoff("dup")
    assert again is not None and again.kv_key == first.kv_key and again.prefill_instance_id == "p0"


async def test_unknown_transfer_id(store: Store) -> None:
    now = t0()
    assert await store.get_handoff("nope") is None
    with pytest.raises(HandoffNotFound):
        await store.mark_ready("nope", LOC, now=now)
    with pytest.raises(HandoffNotFound):
        await store.claim("nope", "d0", now=now, lease_s=1)
    with pytest.raises(HandoffNotFound):
        await store.done("nope", None, now=now)
    with pytest.raises(HandoffNotFound):
        await store.abort("nope", "x", now=now)


async def test_full_handoff(store: Store) -> None:
    now = t0()
    created = await create(store, "h1", now)
    ready = await store.mark_ready("h1", LOC, now=now + 1)
    assert ready.before is S.PENDING
    assert ready.handoff.state is S.READY and ready.handoff.location == LOC
    assert ready.handoff.deadline == pytest.approx(now + 1 + READY_LEASE, abs=1e-3)
    claim = await store.claim("h1", "d0", now=now + 2, lease_s=5.0)
    assert claim.before is S.READY
    rec = claim.handoff
    assert (rec.state, rec.decode_instance_id, rec.claims) == (S.CLAIMED, "d0", 1)
    assert rec.deadline == pytest.approx(now + 7, abs=1e-3)
    done = await store.done("h1", "d0", now=now + 3)
    assert done.before is S.CLAIMED
    rec = done.handoff
    assert rec.state is S.DONE and rec.deadline is None and rec.kv_key == created.kv_key
    assert rec.updated_at == pytest.approx(now + 3) and rec.created_at == pytest.approx(now)
    assert await store.get_handoff("h1") == rec


@pytest.mark.parametrize(
    ("setup", "op", "current"),
    [
        ("pending", "claim", S.PENDING),
        ("pending", "done", S.PENDING),
        ("ready", "ready", S.READY),
        ("ready", "done", S.READY),
        ("claimed", "ready", S.CLAIMED),
        ("done", "ready", S.DONE),
        ("done", "claim", S.DONE),
        ("done", "done", S.DONE),
        ("done", "abort", S.DONE),
        ("aborted", "abort", S.ABORTED),
        ("aborted", "claim", S.ABORTED),
    ],
)
async def test_illegal_transitions_carry_the_current_state_and_change_nothing(
    store: Store, setup: str, op: str, current: HandoffState
) -> None:
    now = t0()
    await create(store, "x", now)
    if setup in ("ready", "claimed", "done"):
        await store.mark_ready("x", LOC, now=now)
    if setup in ("claimed", "done"):
        await store.claim("x", "d0", now=now, lease_s=5)
    if setup == "done":
        await store.done("x", "d0", now=now)
    if setup == "aborted":
        await store.abort("x", "test", now=now)
    before = await store.get_handoff("x")
    calls = {
        "ready": lambda: store.mark_ready("x", LOC, now=now + 1),
        "claim": lambda: store.claim("x", "d9", now=now + 1, lease_s=5),
        "done": lambda: store.done("x", None, now=now + 1),
        "abort": lambda: store.abort("x", "again", now=now + 1),
    }
    with pytest.raises(IllegalTransition) as err:
        await calls[op]()
    assert err.value.current is current
    assert err.value.terminal == current.terminal
    assert await store.get_handoff("x") == before


async def test_claim_is_exclusive_but_idempotent_for_the_claimant(store: Store) -> None:
    now = t0()
    first = await claimed(store, "c", now, decode="d0")
    with pytest.raises(IllegalTransition) as err:
        await store.claim("c", "d1", now=now + 1, lease_s=5)
    assert err.value.current is S.CLAIMED and "d0" in err.value.detail
    again = await store.claim("c", "d0", now=now + 2, lease_s=5)
    assert again.before is S.CLAIMED
    assert again.handoff.claims == first.claims == 1
    assert again.handoff.deadline == pytest.approx(now + 7, abs=1e-3)


async def test_done_by_another_decode_is_refused(store: Store) -> None:
    now = t0()
    await claimed(store, "c", now, decode="d0")
    with pytest.raises(IllegalTransition) as err:
        await store.done("c", "d1", now=now)
    assert err.value.current is S.CLAIMED and err.value.detail == "handoff is claimed by d0, not d1"
    assert (await store.done("c", None, now=now)).handoff.state is S.DONE


async def test_64_concurrent_claimers_exactly_one_wins(make_store: MakeStore, store_kind: str) -> None:
    store = make_store()
    # On Redis, the claimers come through two store clients (two replicas); on memory, one.
    other = make_store(share=store) if store_kind == "redis" else store
    now = t0()
    await create(store, "race", now)
    await store.mark_ready("race", LOC, now=now)

    async def attempt(i: int) -> str | None:
        s = store if i % 2 else other
        try:
            return (await s.claim("race", f"d{i}", now=now, lease_s=5)).handoff.decode_instance_id
        except IllegalTransition as exc:
            assert exc.current is S.CLAIMED
            return None

    results = await asyncio.gather(*(attempt(i) for i in range(64)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    rec = await store.get_handoff("race")
    assert rec is not None and rec.decode_instance_id == winners[0] and rec.claims == 1


@pytest.mark.parametrize("setup", ["pending", "ready", "claimed"])
async def test_abort_from_any_live_state(store: Store, setup: str) -> None:
    now = t0()
    await create(store, "a", now)
    if setup != "pending":
        await store.mark_ready("a", LOC, now=now)
    if setup == "claimed":
        await store.claim("a", "d0", now=now, lease_s=5)
    moved = await store.abort("a", "client went away", now=now + 1)
    assert moved.before.value == setup.upper()
    assert moved.handoff.state is S.ABORTED and moved.handoff.reason == "client went away"
    assert moved.handoff.deadline is None
    assert await store.expire_due(now=now + 10_000) == []


async def test_live_counts_by_state_follow_every_transition(make_store: MakeStore, store_kind: str) -> None:
    """count_handoffs_by_state moves with each transition exactly once (Redis: counters kept by the scripts)."""
    store = make_store()  # POLICY.max_claims == 2
    other = make_store(share=store) if store_kind == "redis" else store  # a second replica reads the same

    async def counts(pending: int, ready: int, claimed: int) -> None:
        want = {S.PENDING: pending, S.READY: ready, S.CLAIMED: claimed}
        assert await store.count_handoffs_by_state() == want
        assert await other.count_handoffs_by_state() == want

    now = t0()
    await counts(0, 0, 0)
    for tid in ("p-abort", "p-expire", "r-abort", "c-done", "c-abort", "c-lapse"):
        await create(store, tid, now)
    await create(store, "r-expire", now, lease_s=5)
    await counts(7, 0, 0)
    with pytest.raises(HandoffExists):
        await create(store, "p-abort", now)
    await counts(7, 0, 0)
    for tid in ("r-abort", "r-expire", "c-done", "c-abort", "c-lapse"):
        await store.mark_ready(tid, LOC, now=now)
    await counts(2, 5, 0)
    await store.claim("c-done", "d0", now=now, lease_s=5)
    await store.claim("c-abort", "d0", now=now, lease_s=5)
    await store.claim("c-lapse", "d0", now=now, lease_s=8)
    await counts(2, 2, 3)
    await store.claim("c-done", "d0", now=now, lease_s=5)  # the claimant renews: no move
    with pytest.raises(IllegalTransition):
        await store.claim("c-done", "d1", now=now, lease_s=5)
    with pytest.raises(IllegalTransition):
        await store.mark_ready("r-abort", LOC, now=now)
    with pytest.raises(HandoffNotFound):
        await store.abort("nope", "x", now=now)
    await counts(2, 2, 3)
    await store.done("c-done", "d0", now=now + 1)
    await counts(2, 2, 2)
    await store.abort("p-abort", "gone", now=now + 1)
    await counts(1, 2, 2)
    await store.abort("r-abort", "gone", now=now + 1)
    await counts(1, 1, 2)
    await store.abort("c-abort", "gone", now=now + 1)
    await counts(1, 1, 1)
    with pytest.raises(IllegalTransition):
        await store.abort("c-done", "late", now=now + 1)  # terminal records are not counted twice
    await counts(1, 1, 1)
    moved = await other.expire_due(now=now + 5.5)  # READY lease lapses
    assert [(m.handoff.transfer_id, m.handoff.state) for m in moved] == [("r-expire", S.EXPIRED)]
    await counts(1, 0, 1)
    moved = await store.expire_due(now=now + 8.5)  # the claim lapses: back to READY
    assert [(m.handoff.transfer_id, m.handoff.state) for m in moved] == [("c-lapse", S.READY)]
    await counts(1, 1, 0)
    await store.claim("c-lapse", "d1", now=now + 9, lease_s=5)
    await counts(1, 0, 1)
    moved = await store.expire_due(now=now + 14.5)  # the last allowed claim lapses: EXPIRED
    assert [(m.handoff.transfer_id, m.handoff.state) for m in moved] == [("c-lapse", S.EXPIRED)]
    await counts(1, 0, 0)
    moved = await store.expire_due(now=now + PENDING_LEASE + 1)  # PENDING lease lapses
    assert [(m.handoff.transfer_id, m.handoff.state) for m in moved] == [("p-expire", S.EXPIRED)]
    await counts(0, 0, 0)
    assert await store.expire_due(now=now + 10_000) == []
    await counts(0, 0, 0)


async def test_live_counts_hold_under_concurrent_claimers(make_store: MakeStore, store_kind: str) -> None:
    store = make_store()
    other = make_store(share=store) if store_kind == "redis" else store
    now = t0()
    await create(store, "race", now)
    await store.mark_ready("race", LOC, now=now)

    async def try_claim(i: int) -> None:
        try:
            await (store if i % 2 else other).claim("race", f"d{i}", now=now, lease_s=5)
        except IllegalTransition:
            pass

    await asyncio.gather(*(try_claim(i) for i in range(32)))
    assert await store.count_handoffs_by_state() == {S.PENDING: 0, S.READY: 0, S.CLAIMED: 1}

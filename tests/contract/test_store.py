"""The store contract: one suite, run against the memory store and a real redis-server.

Time is passed explicitly (`now`), so leases lapse by moving `now`, not by sleeping; only the TTL that
Redis applies by itself (terminal records) is observed in real time, by polling.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound, InvalidInput
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.models import (
    HandoffCreate,
    HandoffState,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    Role,
    TransportAddress,
)
from pdgate.metaserver.registry import new_instance
from pdgate.metaserver.store import LedgerPolicy, Store

from tests.contract.conftest import MakeStore

S = HandoffState
PENDING_LEASE = 60.0
READY_LEASE = 30.0
LOC = KVLocation(
    block_ids=[[3, 4, 5], [9]],
    num_tokens=40,
    engine_id="eng-0",
    host="10.0.0.5",
    dp_rank=1,
    tp_size=2,
    block_size=16,
    transport_addresses=[TransportAddress(tp_rank=0, host="10.0.0.5", port=5600, meta={"agent": "a0", "n": [1, 2]})],
    remote_request_id="cmpl-abc-0",
)


def t0() -> float:
    return time.time()


async def create(store: Store, tid: str, now: float, prefill: str = "p0", lease_s: float | None = None):  # type: ignore[no-untyped-def]
    body = HandoffCreate(prefill_instance_id=prefill, transfer_id=tid, lease_s=lease_s, request_id=f"req-{tid}")
    return await store.create_handoff(
        body, transfer_id=tid, now=now, pending_lease_s=PENDING_LEASE, ready_lease_s=READY_LEASE
    )


async def claimed(store: Store, tid: str, now: float, decode: str = "d0", prefill: str = "p0"):  # type: ignore[no-untyped-def]
    await create(store, tid, now, prefill)
    await store.mark_ready(tid, LOC, now=now)
    return (await store.claim(tid, decode, now=now, lease_s=5.0)).handoff


# -- ledger --------------------------------------------------------------------------------------


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
    assert err.value.current is S.CLAIMED
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


# -- leases ----------------------------------------------------------------------------------------


async def test_pending_and_ready_leases_expire_only_when_due(store: Store) -> None:
    now = t0()
    await create(store, "p", now)
    await create(store, "r", now, lease_s=5)
    await store.mark_ready("r", LOC, now=now)
    assert await store.expire_due(now=now + 4.9) == []
    moved = await store.expire_due(now=now + 5.1)
    assert [(m.before, m.handoff.transfer_id, m.handoff.state) for m in moved] == [(S.READY, "r", S.EXPIRED)]
    assert moved[0].handoff.reason == "READY lease lapsed"
    moved = await store.expire_due(now=now + PENDING_LEASE + 0.1)
    assert [(m.before, m.handoff.state) for m in moved] == [(S.PENDING, S.EXPIRED)]
    assert (await store.get_handoff("p")).state is S.EXPIRED  # type: ignore[union-attr]
    assert await store.expire_due(now=now + 10_000) == []


async def test_lapsed_claim_returns_to_ready_until_max_claims(store: Store) -> None:
    now = t0()  # POLICY.max_claims == 2
    await claimed(store, "c", now, decode="d0")
    moved = await store.expire_due(now=now + 5.5)
    assert len(moved) == 1 and moved[0].before is S.CLAIMED
    rec = moved[0].handoff
    assert rec.state is S.READY and rec.decode_instance_id is None and rec.claims == 1
    assert rec.deadline == pytest.approx(now + 5.5 + READY_LEASE, abs=1e-3)
    with pytest.raises(IllegalTransition):
        await store.done("c", "d0", now=now + 6)  # the lapsed claimant can no longer finish
    await store.claim("c", "d1", now=now + 6, lease_s=5)
    moved = await store.expire_due(now=now + 11.5)
    assert [(m.before, m.handoff.state, m.handoff.claims) for m in moved] == [(S.CLAIMED, S.EXPIRED, 2)]
    assert moved[0].handoff.reason == "CLAIMED lease lapsed"


async def test_a_renewed_claim_does_not_lapse_at_the_old_deadline(store: Store) -> None:
    now = t0()
    await claimed(store, "c", now)
    await store.claim("c", "d0", now=now + 4, lease_s=5)
    assert await store.expire_due(now=now + 6) == []
    assert len(await store.expire_due(now=now + 9.5)) == 1


async def test_two_sweepers_move_each_record_once(make_store: MakeStore, store_kind: str) -> None:
    store = make_store()
    other = make_store(share=store) if store_kind == "redis" else store
    now = t0()
    for i in range(50):
        await create(store, f"e{i}", now)
    a, b = await asyncio.gather(
        store.expire_due(now=now + PENDING_LEASE + 1), other.expire_due(now=now + PENDING_LEASE + 1)
    )
    ids = [m.handoff.transfer_id for m in a + b]
    assert sorted(ids) == sorted(f"e{i}" for i in range(50))


async def test_terminal_records_vanish_after_their_ttl(make_store: MakeStore) -> None:
    store = make_store(LedgerPolicy(terminal_ttl_s=0.2, events_maxlen=100, events_ttl_s=3600, max_claims=2))
    now = t0()
    await create(store, "gone", now)
    await store.abort("gone", "test", now=now)
    deadline = time.monotonic() + 10
    while await store.get_handoff("gone") is not None:
        assert time.monotonic() < deadline, "terminal record still there 10 s after a 0.2 s TTL"
        await store.expire_due(now=time.time())
        await asyncio.sleep(0.05)


# -- event feed ------------------------------------------------------------------------------------


async def test_events_are_the_terminal_moves_of_this_prefill_in_order(store: Store) -> None:
    now = t0()
    await claimed(store, "a", now, prefill="p0")
    await store.done("a", "d0", now=now + 1)
    await create(store, "b", now, prefill="p0")
    await store.abort("b", "client gone", now=now + 2)
    await create(store, "other", now, prefill="p1")
    await store.abort("other", "x", now=now + 2)
    await create(store, "c", now, prefill="p0")
    await store.expire_due(now=now + PENDING_LEASE + 1)
    feed = await store.read_events("p0", None, wait=0)
    got = [(e.transfer_id, e.state, e.reason) for e in feed.events]
    assert got == [("a", S.DONE, None), ("b", S.ABORTED, "client gone"), ("c", S.EXPIRED, "PENDING lease lapsed")]
    a = await store.get_handoff("a")
    assert a is not None and feed.events[0].kv_key == a.kv_key
    assert feed.events[0].at == pytest.approx(now + 1)
    assert [e.transfer_id for e in (await store.read_events("p1", None, wait=0)).events] == ["other"]


async def test_cursor_resumes_without_gaps_or_repeats(store: Store) -> None:
    now = t0()
    for i in range(5):
        await create(store, f"h{i}", now)
        await store.abort(f"h{i}", "x", now=now)
    first = await store.read_events("p0", None, wait=0, limit=2)
    assert [e.transfer_id for e in first.events] == ["h0", "h1"]
    rest = await store.read_events("p0", first.cursor, wait=0)
    assert [e.transfer_id for e in rest.events] == ["h2", "h3", "h4"]
    empty = await store.read_events("p0", rest.cursor, wait=0)
    assert empty.events == [] and empty.cursor == rest.cursor
    await create(store, "h5", now)
    await store.abort("h5", "x", now=now)
    assert [e.transfer_id for e in (await store.read_events("p0", rest.cursor, wait=0)).events] == ["h5"]


async def test_unknown_instance_has_an_empty_feed(store: Store) -> None:
    feed = await store.read_events("nobody", None, wait=0)
    assert feed.events == [] and feed.cursor == "0"


async def test_bad_cursor_is_refused(store: Store) -> None:
    with pytest.raises(InvalidInput):
        await store.read_events("p0", "not-a-cursor", wait=0)


async def test_waiting_reader_wakes_on_the_next_event(store: Store) -> None:
    now = t0()
    await create(store, "w", now)
    reader = asyncio.create_task(store.read_events("p0", None, wait=30))
    await asyncio.sleep(0.1)
    assert not reader.done()
    await store.abort("w", "x", now=now)
    feed = await asyncio.wait_for(reader, 10)
    assert [e.transfer_id for e in feed.events] == ["w"]


async def test_waiting_reader_gives_up_with_its_cursor(store: Store) -> None:
    feed = await store.read_events("p0", None, wait=0.2)
    assert feed.events == [] and feed.cursor == "0"


async def test_wait_handoff_returns_when_it_leaves_pending(store: Store) -> None:
    now = t0()
    await create(store, "lp", now)
    waiter = asyncio.create_task(store.wait_handoff("lp", timeout=30))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await store.mark_ready("lp", LOC, now=now)
    rec = await asyncio.wait_for(waiter, 10)
    assert rec is not None and rec.state is S.READY


async def test_wait_handoff_times_out_with_the_pending_record(store: Store) -> None:
    now = t0()
    await create(store, "lp", now)
    rec = await store.wait_handoff("lp", timeout=0.2)
    assert rec is not None and rec.state is S.PENDING
    assert await store.wait_handoff("unknown", timeout=0.2) is None


# -- registry --------------------------------------------------------------------------------------


def reg(iid: str = "p0", role: Role = Role.PREFILL, **kw: object) -> InstanceRegistration:
    data: dict[str, object] = {"id": iid, "role": role, "url": "http://10.0.0.5:8100", "model": "m"}
    data.update(kw)
    return InstanceRegistration.model_validate(data)


async def register(store: Store, r: InstanceRegistration, now: float, lease: float = 10.0):  # type: ignore[no-untyped-def]
    return await store.register(new_instance(r, now=now, default_lease_s=lease), now=now)


async def test_register_get_list(store: Store) -> None:
    now = t0()
    addr = [TransportAddress(tp_rank=0, device_ip="1.2.3.4", cluster_id=7, meta={"k": [1]})]
    a = await register(store, reg("a", tp_size=2, transport_addresses=addr, labels={"zone": "z1"}), now)
    await register(store, reg("b", Role.DECODE), now)
    got = await store.get_instance("a", now=now + 1)
    assert got == a
    assert got.transport_addresses == addr and got.lease_s == 10.0 and got.state is InstanceState.READY
    assert [i.id for i in await store.list_instances(now=now + 1)] == ["a", "b"]
    assert await store.count_instances(now=now + 1) == 2
    assert await store.get_instance("zzz", now=now) is None


async def test_lapsed_instances_vanish_without_a_delete(store: Store) -> None:
    now = t0()
    await register(store, reg("short"), now, lease=2.0)
    await register(store, reg("long"), now, lease=20.0)
    assert [i.id for i in await store.list_instances(now=now + 3)] == ["long"]
    assert await store.get_instance("short", now=now + 3) is None
    assert await store.heartbeat("short", None, now=now + 3) is None
    assert await store.count_instances(now=now + 3) == 1


async def test_heartbeat_renews_the_lease_and_updates_load(store: Store) -> None:
    now = t0()
    await register(store, reg("a"), now, lease=2.0)
    inst = await store.heartbeat("a", InstanceLoad(running=4, waiting=1, kv_usage=0.5), now=now + 1.5)
    assert inst is not None and inst.last_heartbeat == pytest.approx(now + 1.5) and inst.load.running == 4
    kept = await store.heartbeat("a", None, now=now + 3)
    assert kept is not None and kept.load.running == 4
    assert [i.id for i in await store.list_instances(now=now + 4.5)] == ["a"]


async def test_reregistering_a_live_instance_keeps_its_start_and_drain(store: Store) -> None:
    now = t0()
    first = await register(store, reg("a"), now)
    drained = await store.drain("a", now=now + 1)
    assert drained is not None and drained.state is InstanceState.DRAINING
    again = await register(store, reg("a", model="m2"), now + 2)
    assert again.registered_at == pytest.approx(first.registered_at) and again.state is InstanceState.DRAINING
    got = await store.get_instance("a", now=now + 2)
    assert got is not None and got.model == "m2" and got.state is InstanceState.DRAINING


async def test_registering_after_a_lapse_starts_afresh(store: Store) -> None:
    now = t0()
    await register(store, reg("a"), now, lease=1.0)
    await store.drain("a", now=now)
    fresh = await register(store, reg("a"), now + 5, lease=1.0)
    assert fresh.registered_at == pytest.approx(now + 5) and fresh.state is InstanceState.READY


async def test_drain_and_deregister_unknown(store: Store) -> None:
    now = t0()
    assert await store.drain("nobody", now=now) is None
    assert await store.deregister("nobody") is False
    await register(store, reg("a"), now)
    assert await store.deregister("a") is True
    assert await store.get_instance("a", now=now) is None
    assert await store.list_instances(now=now) == []

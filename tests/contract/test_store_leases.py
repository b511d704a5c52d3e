"""The store contract, leases: what the sweeper's `expire_due` moves, and when (both stores).

Leases lapse by moving `now`, not by sleeping; only the TTL that Redis applies by itself (terminal
records) is observed in real time, by polling.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.store import LedgerPolicy, Store

from tests.contract.conftest import MakeStore
from tests.contract.records import LOC, PENDING_LEASE, READY_LEASE, S, claimed, create, t0


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
    # The record remembers its last claimant (the late DONE), and anyone may claim it again.
    assert rec.state is S.READY and rec.decode_instance_id == "d0" and rec.claims == 1
    assert rec.deadline == pytest.approx(now + 5.5 + READY_LEASE, abs=1e-3)
    await store.claim("c", "d1", now=now + 6, lease_s=5)
    with pytest.raises(IllegalTransition):
        await store.done("c", "d0", now=now + 6.5)  # re-claimed by d1: the lapsed claimant cannot finish
    moved = await store.expire_due(now=now + 11.5)
    assert [(m.before, m.handoff.state, m.handoff.claims) for m in moved] == [(S.CLAIMED, S.EXPIRED, 2)]
    assert moved[0].handoff.reason == "CLAIMED lease lapsed"


async def test_the_lapsed_claimant_finishes_a_requeued_record(store: Store) -> None:
    """A pull verified while the prefill held the blocks, whose DONE arrives after the claim lapsed: the
    DONE still lands, so the prefill hears it on its feed and frees at once (not at the READY lease)."""
    now = t0()
    await claimed(store, "late", now, decode="d0")
    (back,) = await store.expire_due(now=now + 5.5)
    assert back.handoff.state is S.READY
    moved = await store.done("late", "d0", now=now + 6)
    assert moved.before is S.READY and moved.handoff.state is S.DONE and moved.handoff.deadline is None
    events = await store.read_events("p0", None, wait=0)
    assert [(e.transfer_id, e.state) for e in events.events][-1:] == [("late", S.DONE)]
    assert await store.expire_due(now=now + 1000) == []  # nothing left to lapse


async def test_only_the_lapsed_claimant_naming_itself_finishes_a_requeued_record(store: Store) -> None:
    now = t0()
    await claimed(store, "r", now, decode="d0")
    await store.expire_due(now=now + 5.5)
    for caller in (None, "d1"):  # anonymous, or another decode: the record's READY, not theirs
        with pytest.raises(IllegalTransition) as err:
            await store.done("r", caller, now=now + 6)
        assert err.value.current is S.READY
    # A record that was never claimed has no last claimant: DONE is refused as before.
    await create(store, "fresh", now)
    await store.mark_ready("fresh", LOC, now=now)
    with pytest.raises(IllegalTransition):
        await store.done("fresh", "d0", now=now + 1)
    assert (await store.get_handoff("r")).state is S.READY  # type: ignore[union-attr]


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

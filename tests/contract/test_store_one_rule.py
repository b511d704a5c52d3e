"""The store contract, the two points where the ledger's interpreters once differed; each is one rule now.

* A move with both a caller value for `reason` and a fixed `reason`: `ledger.Move.reason_from` decides (the
  caller's value wins), and both `ledger.apply` (memory) and `_lib.lua` (Redis) read it. No move of today's
  table has both, so the tests give the table such a row before the store loads it.
* The kv_key clock floor: `ledger.kv_key_floor` is the formula; the memory store calls it, create.lua
  computes it from Redis TIME with `ledger.KV_KEYS_PER_MS`. Both stores must issue keys at that floor.
"""

from __future__ import annotations

import time

import pytest
from pdgate.metaserver import ledger
from pdgate.metaserver.ledger import Lease, Move

from tests.contract.conftest import MakeStore
from tests.contract.records import LOC, S, create, t0


async def test_a_caller_reason_wins_over_a_fixed_one_on_a_terminal_move(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    abort = ledger.MOVES["abort"]
    both = Move("abort", abort.sources, abort.to, field="reason", reason="%s dropped by the table")
    monkeypatch.setitem(ledger.MOVES, "abort", both)  # type: ignore[attr-defined]
    store = make_store()  # the Redis store renders ledger.MOVES into its scripts here
    now = t0()
    await create(store, "t1", now)
    moved = await store.abort("t1", "client gone", now=now + 1)
    assert (moved.handoff.state, moved.handoff.reason) == (S.ABORTED, "client gone")
    assert (await store.get_handoff("t1")) == moved.handoff
    feed = await store.read_events("p0", None, wait=0)
    assert [(e.transfer_id, e.reason) for e in feed.events] == [("t1", "client gone")]


async def test_a_fixed_reason_on_a_live_move_is_written_beside_its_field(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = ledger.MOVES["ready"]
    with_reason = Move("ready", ready.sources, ready.to, Lease.RECORD, field="location", reason="left %s")
    monkeypatch.setitem(ledger.MOVES, "ready", with_reason)  # type: ignore[attr-defined]
    store = make_store()
    now = t0()
    await create(store, "t2", now)
    rec = (await store.mark_ready("t2", LOC, now=now + 1)).handoff
    assert (rec.state, rec.location, rec.reason) == (S.READY, LOC, "left PENDING")


def test_reason_from_is_the_one_precedence() -> None:
    assert Move("m", frozenset(), S.ABORTED, field="reason", reason="x %s").reason_from == "value"
    assert Move("m", frozenset(), S.EXPIRED, reason="x %s").reason_from == "fixed"
    assert Move("m", frozenset(), S.READY, Lease.RECORD, field="location").reason_from is None


async def test_kv_keys_start_at_the_one_clock_floor(make_store: MakeStore) -> None:
    """Both stores issue their first kv_key at `kv_key_floor` of their clock (the memory store's and Redis
    TIME are this machine's clock): the old formulas (seconds << 20 here, ms << 10 in Lua) differed by
    ~2.4% of the value, so either store on the other's formula fails this."""
    store = make_store()
    before = ledger.kv_key_floor(time.time()) - ledger.KV_KEYS_PER_MS  # one ms of slack for rounding
    first = await create(store, "k0", t0())
    second = await create(store, "k1", t0())
    after = ledger.kv_key_floor(time.time()) + ledger.KV_KEYS_PER_MS
    assert before - 1024 <= first.kv_key <= after  # a shard's bits (at most 1024 buckets) sit below
    assert first.kv_key < second.kv_key <= after + 1024

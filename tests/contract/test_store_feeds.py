"""The store contract, long-polls: each prefill's event feed and the wait for a handoff to leave PENDING."""

from __future__ import annotations

import asyncio

import pytest
from pdgate.metaserver.errors import InvalidInput
from pdgate.metaserver.store import Store

from tests.contract.records import LOC, PENDING_LEASE, S, claimed, create, t0


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

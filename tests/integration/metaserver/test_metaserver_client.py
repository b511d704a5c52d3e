"""Every route through the MetaAPI: MetaClient against a real server, and LocalMetaClient in-process.

Both must give the same answers and raise the same typed errors, on both stores.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdgate.meta_client import MetaBadRequest, MetaConflict, MetaGone, MetaNotFound
from pdgate.models import (
    HandoffCreate,
    HandoffState,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    Role,
    TransportAddress,
    TransportKind,
)
from tests.support.meta import uid

S = HandoffState
LOC = KVLocation(
    block_ids=[[1, 2, 3]],
    num_tokens=48,
    engine_id="e0",
    host="10.1.1.1",
    tp_size=1,
    block_size=16,
    transport=TransportKind.LLMDATADIST,
    transport_addresses=[TransportAddress(tp_rank=0, device_ip="10.2.0.1", cluster_id=3, super_device_id=9)],
)


def reg(iid: str, role: Role, model: str, **kw: Any) -> InstanceRegistration:
    return InstanceRegistration(id=iid, role=role, url="http://10.0.0.1:8000", model=model, **kw)


async def test_registry_routes(meta: Any) -> None:
    model = uid("model")
    p, d, b = uid("p"), uid("d"), uid("b")
    resp = await meta.register(reg(p, Role.PREFILL, model, lease_s=30, labels={"zone": "a"}))
    assert resp.lease_s == 30 and resp.instance.id == p and resp.instance.state is InstanceState.READY
    await meta.register(reg(d, Role.DECODE, model))
    await meta.register(reg(b, Role.BOTH, model))
    listed = await meta.list_instances(model=model)
    assert sorted(i.id for i in listed) == sorted([p, d, b])
    assert sorted(i.id for i in await meta.list_instances(model=model, role=Role.PREFILL)) == sorted([p, b])
    assert [i.id for i in await meta.list_instances(model=model, role=Role.BOTH)] == [b]
    hb = await meta.heartbeat(p, InstanceLoad(running=5, waiting=2, kv_usage=0.25))
    assert hb.lease_s == 30 and hb.state is InstanceState.READY
    got = await meta.get_instance(p)
    assert got.load.running == 5 and got.labels == {"zone": "a"}
    drained = await meta.drain(d)
    assert drained.state is InstanceState.DRAINING
    assert (await meta.heartbeat(d)).state is InstanceState.DRAINING
    assert [i.id for i in await meta.list_instances(model=model, state=InstanceState.DRAINING)] == [d]
    await meta.deregister(d)
    with pytest.raises(MetaNotFound):
        await meta.get_instance(d)
    with pytest.raises(MetaNotFound):
        await meta.heartbeat(d)
    with pytest.raises(MetaNotFound):
        await meta.drain(d)
    with pytest.raises(MetaNotFound):
        await meta.deregister(d)


async def test_handoff_routes_and_typed_errors(meta: Any) -> None:
    p = uid("p")
    h = await meta.create_handoff(HandoffCreate(prefill_instance_id=p, request_id="req-1"))
    assert h.state is S.PENDING and h.transfer_id and h.kv_key >= 1 and h.request_id == "req-1"
    tid = h.transfer_id
    with pytest.raises(MetaConflict) as err:
        await meta.create_handoff(HandoffCreate(prefill_instance_id=p, transfer_id=tid))
    assert err.value.code == "handoff_exists"
    with pytest.raises(MetaConflict) as err:
        await meta.claim(tid, "d0")
    assert err.value.current_state is S.PENDING and err.value.code == "illegal_transition"
    ready = await meta.mark_ready(tid, LOC)
    assert ready.state is S.READY and ready.location == LOC
    claimed = await meta.claim(tid, "d0", lease_s=20)
    assert claimed.state is S.CLAIMED and claimed.deadline == pytest.approx(claimed.updated_at + 20, abs=1e-3)
    assert (await meta.claim(tid, "d0")).claims == 1  # the claimant's retry is idempotent
    with pytest.raises(MetaConflict) as err:
        await meta.claim(tid, "d1")
    assert err.value.current_state is S.CLAIMED
    with pytest.raises(MetaConflict):
        await meta.done(tid, "d1")
    done = await meta.done(tid, "d0")
    assert done.state is S.DONE and done.deadline is None
    for call in (meta.done(tid, "d0"), meta.abort(tid, "late"), meta.claim(tid, "d0"), meta.mark_ready(tid, LOC)):
        with pytest.raises(MetaGone) as gone:
            await call
        assert gone.value.current_state is S.DONE and gone.value.status == 410
    assert (await meta.get_handoff(tid)).state is S.DONE
    with pytest.raises(MetaNotFound):
        await meta.get_handoff(uid("none"))
    with pytest.raises(MetaNotFound):
        await meta.mark_ready(uid("none"), LOC)

    other = await meta.create_handoff(HandoffCreate(prefill_instance_id=p, transfer_id=uid("t")))
    aborted = await meta.abort(other.transfer_id, "client disconnected")
    assert aborted.state is S.ABORTED and aborted.reason == "client disconnected"
    with pytest.raises(MetaGone):
        await meta.abort(other.transfer_id, "again")

    feed = await meta.events(p)
    assert [(e.transfer_id, e.state) for e in feed.events] == [(tid, S.DONE), (other.transfer_id, S.ABORTED)]
    assert (await meta.events(p, cursor=feed.cursor)).events == []


async def test_bad_ids_are_refused(meta: Any) -> None:
    with pytest.raises(MetaBadRequest):
        await meta.claim("bad id!", "d0")
    with pytest.raises((MetaBadRequest, MetaNotFound)):
        await meta.get_instance("no/such")


async def test_long_poll_returns_when_the_record_leaves_pending(meta: Any) -> None:
    h = await meta.create_handoff(HandoffCreate(prefill_instance_id=uid("p")))
    waiter = asyncio.create_task(meta.get_handoff(h.transfer_id, wait=30))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await meta.mark_ready(h.transfer_id, LOC)
    got = await asyncio.wait_for(waiter, 10)
    assert got.state is S.READY


async def test_long_poll_times_out_with_the_pending_record(meta: Any) -> None:
    h = await meta.create_handoff(HandoffCreate(prefill_instance_id=uid("p")))
    got = await meta.get_handoff(h.transfer_id, wait=0.3)
    assert got.state is S.PENDING


async def test_event_feed_long_poll_wakes_on_the_next_terminal_event(meta: Any) -> None:
    p = uid("p")
    first = await meta.create_handoff(HandoffCreate(prefill_instance_id=p))
    await meta.abort(first.transfer_id, "x")
    feed = await meta.events(p)
    reader = asyncio.create_task(meta.events(p, cursor=feed.cursor, wait=30))
    await asyncio.sleep(0.2)
    assert not reader.done()
    second = await meta.create_handoff(HandoffCreate(prefill_instance_id=p))
    await meta.mark_ready(second.transfer_id, LOC)
    await meta.claim(second.transfer_id, "d0")
    await meta.done(second.transfer_id, "d0")
    got = await asyncio.wait_for(reader, 10)
    assert [(e.transfer_id, e.state) for e in got.events] == [(second.transfer_id, S.DONE)]


async def test_health(meta: Any) -> None:
    assert (await meta.health())["status"] == "ok"

"""The store contract, registry: leases of instances, re-registration, drain (both stores)."""

from __future__ import annotations

import pytest
from pdgate.metaserver.store import Store

from pdgate.models import InstanceLoad, InstanceState, Role, TransportAddress
from tests.contract.records import reg, register, t0


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


async def test_an_instance_counts_until_the_last_instant_of_its_lease(store: Store) -> None:
    """`registry.is_live` and its Lua twin (`instance_live`, used by heartbeat and drain) agree at the edge."""
    now = t0()
    await register(store, reg("edge"), now, lease=2.0)
    await register(store, reg("gone"), now, lease=2.0)
    last = now + 2.0
    assert (await store.get_instance("edge", now=last)) is not None
    assert [i.id for i in await store.list_instances(now=last)] == ["edge", "gone"]
    assert (await store.drain("gone", now=last)) is not None
    renewed = await store.heartbeat("edge", None, now=last)
    assert renewed is not None and renewed.last_heartbeat == pytest.approx(last)
    after = last + 2.0 + 0.001
    assert await store.get_instance("edge", now=after) is None
    assert await store.heartbeat("edge", None, now=after) is None
    assert await store.drain("edge", now=after) is None
    again = await register(store, reg("gone"), last, lease=2.0)
    assert again.state is InstanceState.DRAINING  # still live at `last`: register.lua keeps the drain
    assert (await register(store, reg("gone"), last + 2.0 + 0.001)).state is InstanceState.READY

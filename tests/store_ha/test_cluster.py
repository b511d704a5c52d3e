"""Redis Cluster: the ledger sharded by prefill over a real three-master cluster (`servers.RedisClusterServers`).

The store contract suite runs unchanged on the cluster too (tests/contract, param `cluster`); these
tests check what only a cluster has: keys spread over every master, a shard's keys in one slot, the
sweeper and the per-state counts across shards, and a transition caught by a slot migration.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest
import redis
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound, StoreUnavailable
from pdgate.metaserver.store import Store, open_store, wakeups
from pdgate.metaserver.store.redis import RedisStore
from redis.crc import key_slot

from pdgate.errors import Code
from pdgate.models import HandoffCreate, HandoffState, KVLocation
from tests.store_ha.servers import BOUND_S, RedisClusterServers, redis_cli
from tests.support.ports import wait_until

pytestmark = pytest.mark.store_ha

S = HandoffState
LOC = KVLocation(block_ids=[[1, 2]], num_tokens=16, engine_id="eng-p", host="10.0.0.1")


def _slot(key: str) -> int:
    return key_slot(key.encode())


async def _lifecycle(store: Store, tid: str, prefill: str, now: float) -> int:
    """Create, READY, CLAIMED, DONE; the kv_key."""
    rec = await store.create_handoff(
        HandoffCreate(prefill_instance_id=prefill), transfer_id=tid, now=now, pending_lease_s=30, ready_lease_s=30
    )
    await store.mark_ready(tid, LOC, now=now)
    await store.claim(tid, "d0", now=now, lease_s=30)
    await store.done(tid, "d0", now=now)
    return rec.kv_key


async def test_1000_handoffs_over_30_prefills_spread_over_all_three_shards(
    redis_cluster: RedisClusterServers,
) -> None:
    store = open_store(redis_cluster.url(f"t{uuid.uuid4().hex[:8]}"))
    assert isinstance(store, RedisStore) and store.keys.sharded
    prefills = [f"prefill-{i}" for i in range(30)]
    now = time.time()
    try:
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> int:
            async with sem:
                return await _lifecycle(store, f"h{i}", prefills[i % 30], now)

        kv_keys = await asyncio.gather(*(one(i) for i in range(1000)))
        assert len(set(kv_keys)) == 1000
        # The shard bits: each key's low part names the bucket of its prefill (no cross-shard counter).
        buckets = len(store.keys.shards)
        for i, kv in enumerate(kv_keys):
            assert kv % buckets == store.keys.bucket_of(prefills[i % 30])

        # Where the keys really are: ask every master which of this store's records it holds.
        per_node: Counter[int] = Counter()
        for i in range(1000):
            shard = store.keys.shard_of(prefills[i % 30])
            record = shard.handoff(f"h{i}")
            # One slot per transition: the record, its shard's deadline index, its prefill's stream.
            assert _slot(record) == _slot(shard.deadlines) == _slot(shard.events(prefills[i % 30]))
            owner = redis_cluster.owner(_slot(record))
            assert redis_cli(owner, "exists", record) == "1"
            per_node[owner] += 1
        assert set(per_node) == set(redis_cluster.ports), per_node
        print(f"\nhandoffs per master: {dict(per_node)}")
        assert min(per_node.values()) >= 100, per_node  # no master left nearly idle

        # Every prefill's feed has its 1000/30 events, whichever master holds it.
        for p in prefills:
            feed = await store.read_events(p, None, wait=0)
            assert len(feed.events) == sum(1 for i in range(1000) if i % 30 == prefills.index(p))
    finally:
        await store.close()


async def test_sweeper_and_per_state_counts_work_across_shards(redis_cluster: RedisClusterServers) -> None:
    store = open_store(redis_cluster.url(f"t{uuid.uuid4().hex[:8]}"))
    prefills = [f"pf-{i}" for i in range(30)]
    now = time.time()
    try:
        for i in range(90):
            await store.create_handoff(
                HandoffCreate(prefill_instance_id=prefills[i % 30]),
                transfer_id=f"s{i}",
                now=now,
                pending_lease_s=5,
                ready_lease_s=5,
            )
        for i in range(30):
            await store.mark_ready(f"s{i}", LOC, now=now)
        counts = await store.count_handoffs_by_state()
        assert (counts[S.PENDING], counts[S.READY], counts[S.CLAIMED]) == (60, 30, 0)
        # Nothing is due yet; then everything is, in every shard at once.
        assert await store.expire_due(now=now + 1) == []
        moved = await store.expire_due(now=now + 6, limit=1000)
        assert sorted(m.handoff.transfer_id for m in moved) == sorted(f"s{i}" for i in range(90))
        assert {m.handoff.state for m in moved} == {S.EXPIRED}
        assert await store.count_handoffs_by_state() == {S.PENDING: 0, S.READY: 0, S.CLAIMED: 0}
        for p in prefills:  # each prefill hears of its three expiries on its own shard's stream
            assert len((await store.read_events(p, None, wait=0)).events) == 3
    finally:
        await store.close()


def _keys_in_slot(port: int, slot: int) -> list[str]:
    out = redis_cli(port, "cluster", "getkeysinslot", str(slot), "1000")
    return [k for k in out.splitlines() if k]


def _asking_hgetall(port: int, key: str) -> dict[str, str]:
    """HGETALL on an importing master: ASKING first, on the same connection (what an ASK redirect does)."""
    with redis.Redis(port=port, decode_responses=True, single_connection_client=True) as node:
        node.execute_command("ASKING")
        return node.hgetall(key)  # type: ignore[return-value]


def _migrate(src: int, dst: int, keys: list[str]) -> None:
    redis_cli(src, "migrate", "127.0.0.1", str(dst), "", "0", "5000", "keys", *keys)


async def test_a_transition_fails_atomically_while_its_slot_moves(redis_cluster: RedisClusterServers) -> None:
    """Mid-migration, the record is on the new master and its deadline index still on the old one: the
    script cannot run whole, so it runs not at all (typed 503) and nothing of it is written. Once the
    slot has moved, the same transition succeeds; redis-py follows the MOVED answer, not our code."""
    store = open_store(redis_cluster.url(f"t{uuid.uuid4().hex[:8]}"))
    assert isinstance(store, RedisStore)
    now = time.time()
    try:
        prefill = "mover"
        await store.create_handoff(
            HandoffCreate(prefill_instance_id=prefill), transfer_id="m1", now=now, pending_lease_s=30, ready_lease_s=30
        )
        await store.mark_ready("m1", LOC, now=now)
        shard = store.keys.shard_of(prefill)
        slot = _slot(shard.deadlines)
        src = redis_cluster.owner(slot)
        dst = next(p for p in redis_cluster.ports if p != src)
        src_id, dst_id = redis_cluster.node_id(src), redis_cluster.node_id(dst)
        redis_cli(dst, "cluster", "setslot", str(slot), "importing", src_id)
        redis_cli(src, "cluster", "setslot", str(slot), "migrating", dst_id)
        _migrate(src, dst, [shard.handoff("m1")])  # the record moves first; the index stays behind

        with pytest.raises(StoreUnavailable) as err:
            await store.claim("m1", "d0", now=now, lease_s=30)
        assert err.value.code is Code.STORE_UNAVAILABLE and err.value.status == 503
        # Nothing of the refused step was written: the record (read on its new master) is still READY
        # with no claimant, and the index on the old master still holds the READY deadline.
        record = _asking_hgetall(dst, shard.handoff("m1"))
        assert (record["state"], record.get("decode_instance_id"), record["claims"]) == ("READY", None, "0")
        assert redis_cli(src, "zscore", shard.deadlines, "m1") != ""

        # Finish the move: the rest of the slot's keys, then the slot itself, on every master.
        _migrate(src, dst, _keys_in_slot(src, slot))
        for port in redis_cluster.ports:
            redis_cli(port, "cluster", "setslot", str(slot), "node", dst_id)
        assert redis_cluster.owner(slot) == dst

        moved = await store.claim("m1", "d0", now=now, lease_s=30)
        assert (moved.before, moved.handoff.state, moved.handoff.decode_instance_id) == (S.READY, S.CLAIMED, "d0")
        assert moved.handoff.claims == 1  # the refused try left no trace
        done = await store.done("m1", "d0", now=now)
        assert done.handoff.state is S.DONE
        assert [e.transfer_id for e in (await store.read_events(prefill, None, wait=0)).events] == ["m1"]
        assert redis_cli(dst, "exists", shard.deadlines) in ("0", "1")  # served by its new master
        assert _keys_in_slot(src, slot) == []
    finally:
        await store.close()


async def test_another_replica_finds_the_shard_and_an_id_cannot_live_in_two_shards(
    redis_cluster: RedisClusterServers,
) -> None:
    """A second store on the same cluster (another metaserver replica, which did not create the handoff)
    finds its shard through the locator; a create reusing the id for a prefill of another shard is
    refused, and no second record appears there."""
    url = redis_cluster.url(f"t{uuid.uuid4().hex[:8]}")
    first, second = open_store(url), open_store(url)
    assert isinstance(first, RedisStore)
    now = time.time()
    a = "prefill-a"
    b = next(f"prefill-b{i}" for i in range(1000) if first.keys.bucket_of(f"prefill-b{i}") != first.keys.bucket_of(a))
    try:
        await first.create_handoff(
            HandoffCreate(prefill_instance_id=a), transfer_id="x1", now=now, pending_lease_s=30, ready_lease_s=30
        )
        moved = await second.mark_ready("x1", LOC, now=now)
        assert (moved.before, moved.handoff.state) == (S.PENDING, S.READY)
        with pytest.raises(HandoffExists) as err:
            await second.create_handoff(
                HandoffCreate(prefill_instance_id=b), transfer_id="x1", now=now, pending_lease_s=30, ready_lease_s=30
            )
        assert err.value.current_state is S.READY
        other = first.keys.shard_of(b).handoff("x1")
        assert redis_cli(redis_cluster.owner(_slot(other)), "exists", other) == "0"
        assert await second.get_handoff("unknown-id") is None
        with pytest.raises(HandoffNotFound):
            await second.claim("unknown-id", "d0", now=now, lease_s=30)
    finally:
        await first.close()
        await second.close()


async def test_long_polls_wake_on_their_shards_channel(
    redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster the wake-up of a long-poll is an SPUBLISH on the shard's own channel, heard by one
    subscription per master (a plain PUBLISH would cross the bus to every node). With the waiters'
    periodic re-read pushed past the poll's end, the listener must hear every id."""
    monkeypatch.setattr(wakeups, "RECHECK_S", 60.0)
    store = open_store(redis_cluster.url(f"t{uuid.uuid4().hex[:8]}"))
    assert isinstance(store, RedisStore)
    now = time.time()
    prefills = [f"pw-{i}" for i in range(30)]
    try:
        for i, p in enumerate(prefills):
            await store.create_handoff(
                HandoffCreate(prefill_instance_id=p), transfer_id=f"w{i}", now=now, pending_lease_s=60, ready_lease_s=60
            )
        heard: list[str] = []
        wake = store._wakeups._wake
        monkeypatch.setattr(store._wakeups, "_wake", lambda tid: (heard.append(tid), wake(tid)))
        polls = [asyncio.create_task(store.wait_handoff(f"w{i}", timeout=30)) for i in range(30)]
        # Every shard channel has its one subscriber, on the master that serves it.
        channels = [s.left_pending for s in store.keys.shards]

        def subscribed() -> bool:
            for channel in channels:
                out = redis_cli(redis_cluster.owner(_slot(channel)), "pubsub", "shardnumsub", channel).split()
                if out[-1] != "1":
                    return False
            return True

        await asyncio.to_thread(wait_until, subscribed, timeout=BOUND_S, what="shard channels subscribed")
        assert redis_cli(redis_cluster.ports[0], "pubsub", "numsub", store.keys.left_pending).split()[-1] == "0"
        for i in range(30):
            await store.mark_ready(f"w{i}", LOC, now=now)
        woken = await asyncio.gather(*polls)
        assert [h.state if h else None for h in woken] == [S.READY] * 30
        assert sorted(heard) == sorted(f"w{i}" for i in range(30))  # each woken by its shard's message
    finally:
        await store.close()

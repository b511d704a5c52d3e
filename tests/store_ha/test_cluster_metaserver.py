"""The metaserver itself on a real three-master Redis Cluster, over real HTTP: its sweeper expires leases
in every shard, its per-state gauges sum the shards, and its registry (one slot) works alongside."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store.keys import Keys
from redis.crc import key_slot

from pdgate.meta_client import MetaClient
from pdgate.models import HandoffCreate, HandoffState, InstanceRegistration, KVLocation
from tests.store_ha.servers import RedisClusterServers
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

pytestmark = pytest.mark.store_ha

S = HandoffState
LOC = KVLocation(block_ids=[[1, 2]], num_tokens=16, engine_id="eng-p", host="10.0.0.1")


def _gauges(metrics: str) -> dict[str, float]:
    out = {}
    for state in ("PENDING", "READY", "CLAIMED"):
        prefix = f'pdgate_metaserver_handoffs{{state="{state}"}} '
        out[state] = next(float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix))
    return out


async def test_sweeper_gauges_and_registry_of_a_metaserver_on_a_cluster(redis_cluster: RedisClusterServers) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = MetaSettings(
        store=redis_cluster.url(prefix), sweep_interval_s=0.05, pending_lease_s=8.0, ready_lease_s=8.0
    )
    prefills = [f"prefill-{i}" for i in range(30)]
    keys = Keys(prefix, buckets=64)
    # The 30 prefills' handoffs live on every master (the same hash as the store's).
    owners = Counter(redis_cluster.owner(key_slot(keys.shard_of(p).deadlines.encode())) for p in prefills)
    assert set(owners) == set(redis_cluster.ports)
    with UvicornThread(create_app(settings)) as server:
        async with MetaClient(server.url, timeout=10) as meta, httpx.AsyncClient(base_url=server.url) as http:
            reg = InstanceRegistration(id="p-reg", role="prefill", url="http://10.0.0.9:8100", model="m")
            await meta.register(reg)
            assert [i.id for i in await meta.list_instances()] == ["p-reg"]

            made = await asyncio.gather(
                *(meta.create_handoff(HandoffCreate(prefill_instance_id=prefills[i % 30])) for i in range(60))
            )
            await asyncio.gather(*(meta.mark_ready(h.transfer_id, LOC) for h in made[:30]))
            assert _gauges((await http.get("/metrics")).text) == {"PENDING": 30.0, "READY": 30.0, "CLAIMED": 0.0}

            # No one claims: the sweeper (the app's own task) expires all 60, in every shard.
            async def all_expired() -> bool:
                return _gauges((await http.get("/metrics")).text) == {"PENDING": 0.0, "READY": 0.0, "CLAIMED": 0.0}

            loop = asyncio.get_running_loop()
            await asyncio.to_thread(
                wait_until,
                lambda: asyncio.run_coroutine_threadsafe(all_expired(), loop).result(),
                timeout=60,
                what="the sweeper expired every lease",
            )
            for i, p in enumerate(prefills):
                feed = await meta.events(p)
                assert sorted(e.transfer_id for e in feed.events) == sorted(h.transfer_id for h in made[i::30]), p
                assert {e.state for e in feed.events} == {S.EXPIRED}

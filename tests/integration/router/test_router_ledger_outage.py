"""A ledger outage is not the death of every instance (issue 10: Redis down past the instance lease).

Real parts: a `redis-server` (no persistence, so a restart comes back empty), the metaserver service on
it in-process (`LocalMetaClient`, as the embedded router runs it), the router's own `Discovery` and
`Pool`. What must hold:
- while the store is down the router keeps its last snapshot, and decode failures caused by the outage
  (every claim fails) do not open the breakers; breakers that opened just before the outage was noticed
  are closed again;
- right after the store is back, instances that lapsed or vanished only because they could not
  heartbeat stay in the pool for their lease while they re-register; one that never comes back leaves.
On the old code the pool emptied on the first read after the restart and the breakers stayed open, so
the router answered `pd_no_compatible_pair` instead of serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.breaker import BreakerConfig, BreakerState
from pdgate.router.discovery import Discovery
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import Pool
from pdgate.router.settings import RouterSettings

from pdgate.models import InstanceRegistration, Role
from pdgate.upstream import Upstream
from tests.support.redis import RedisServer

LEASE_S = 1.0
REFRESH_S = 0.2


def _reg(iid: str, role: Role, port: int) -> InstanceRegistration:
    return InstanceRegistration(
        id=iid, role=role, url=f"http://127.0.0.1:{port}", model="m", block_size=16, lease_s=LEASE_S
    )


def _no_upstream() -> Upstream:
    raise AssertionError("no engine is contacted in this test")


@contextlib.asynccontextmanager
async def _stack(
    redis: RedisServer, refresh_s: float = REFRESH_S
) -> AsyncIterator[tuple[LocalMetaClient, Discovery, Pool]]:
    settings = RouterSettings(refresh_interval_s=refresh_s, breaker_failures=2, breaker_open_s=60.0)
    pool = Pool(BreakerConfig(failures=2, open_s=60.0))
    async with running_service(MetaSettings(store=redis.url), sweep=False) as svc:
        meta = LocalMetaClient(svc)
        yield meta, Discovery(settings, pool, lambda: meta, _no_upstream, RouterMetrics(), time.monotonic), pool


def _fail(pool: Pool, iid: str, times: int) -> None:
    for _ in range(times):
        with pool.lease(pool.instances[iid], 1, time.monotonic) as lease:
            lease.failed()


@pytest.mark.parametrize("aof", [False, True], ids=["restart-empty", "restart-aof"])
async def test_pool_and_breakers_survive_a_store_outage_past_the_lease(aof: bool) -> None:
    extra = ["--appendonly", "yes", "--appendfsync", "always"] if aof else None
    with RedisServer(extra_args=extra) as redis:
        async with _stack(redis) as (meta, disc, pool):
            for reg in (_reg("p", Role.PREFILL, 9001), _reg("d", Role.DECODE, 9002), _reg("d2", Role.DECODE, 9003)):
                await meta.register(reg)
            await disc.refresh_once()
            assert pool.models(time.monotonic()) == ["m"] and sorted(pool.instances) == ["d", "d2", "p"]

            redis.stop()
            _fail(pool, "d", 2)  # claims fail as the store dies, before the router notices
            assert pool.instances["d"].breaker.state(time.monotonic()) is BreakerState.OPEN
            await disc.refresh_once()  # the read fails: the outage is noticed
            now = time.monotonic()
            assert disc.registry_reason is not None and sorted(pool.instances) == ["d", "d2", "p"]
            assert pool.instances["d"].breaker.state(now) is BreakerState.CLOSED  # forgiven
            _fail(pool, "d2", 3)  # while it is known down, failures are the outage's
            assert pool.instances["d2"].breaker.state(time.monotonic()) is BreakerState.CLOSED
            await asyncio.sleep(LEASE_S + 0.3)  # the outage lasts past every instance's lease (a cause, not an effect)

            redis.start()
            await disc.refresh_once()  # readable again, but p, d and d2 are lapsed or gone there
            assert disc.registry_reason is None
            assert sorted(pool.instances) == ["d", "d2", "p"] and pool.models(time.monotonic()) == ["m"]
            _fail(pool, "d2", 2)  # the ledger is back: failures count again
            assert pool.instances["d2"].breaker.state(time.monotonic()) is BreakerState.OPEN

            # p and d heartbeat again, d2 never does: once the grace is over (LEASE_S + REFRESH_S after the
            # store came back) d2 leaves, and p and d stay all along. Waited for, not slept for.
            deadline = time.monotonic() + 30
            while "d2" in pool.instances:
                assert time.monotonic() < deadline, "d2 outlived the grace by far"
                await meta.register(_reg("p", Role.PREFILL, 9001))
                await meta.register(_reg("d", Role.DECODE, 9002))
                await disc.refresh_once()
                assert {"d", "p"} <= set(pool.instances)
                await asyncio.sleep(REFRESH_S / 2)
            assert sorted(pool.instances) == ["d", "p"] and pool.models(time.monotonic()) == ["m"]


async def test_without_an_outage_a_vanished_instance_leaves_at_once() -> None:
    with RedisServer() as redis:
        async with _stack(redis) as (meta, disc, pool):
            await meta.register(_reg("p", Role.PREFILL, 9001))
            await meta.register(_reg("d", Role.DECODE, 9002))
            await disc.refresh_once()
            assert sorted(pool.instances) == ["d", "p"]
            await meta.deregister("d")
            await disc.refresh_once()
            assert sorted(pool.instances) == ["p"] and pool.models(time.monotonic()) == []
            _fail(pool, "p", 2)  # no outage: an instance's failures open its breaker
            assert pool.instances["p"].breaker.state(time.monotonic()) is BreakerState.OPEN


async def test_an_opening_breaker_checks_the_ledger_at_once() -> None:
    """The outage shows first as every decode failing: the breaker that opens triggers a registry read,
    which finds the store down and closes it again, long before the next scheduled refresh."""
    with RedisServer() as redis:
        async with _stack(redis, refresh_s=600.0) as (meta, disc, pool):
            await meta.register(_reg("p", Role.PREFILL, 9001))
            await meta.register(_reg("d", Role.DECODE, 9002))
            await disc.refresh_once()
            disc.start()  # the scheduled refresh is ten minutes away
            try:
                redis.stop()
                _fail(pool, "d", 2)  # its breaker opens...
                assert pool.instances["d"].breaker.state(time.monotonic()) is BreakerState.OPEN
                check = disc._check  # ...and that started one registry read
                assert check is not None
                await check
                assert disc.registry_reason is not None and pool.ledger_down
                assert pool.instances["d"].breaker.state(time.monotonic()) is BreakerState.CLOSED
                assert pool.models(time.monotonic()) == ["m"]
            finally:
                await disc.stop()

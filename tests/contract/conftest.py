"""Fixtures of the store contract suite: every fixture here is parametrized over every backend.

`cluster` is the Redis store on a real three-master Redis Cluster (started once per session, only when
a cluster test runs): the same tests, unchanged, with the ledger sharded over the three masters."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from pdgate.metaserver.store import LedgerPolicy, Store, open_store

from tests.store_ha.servers import RedisClusterServers
from tests.support.redis import RedisServer

POLICY = LedgerPolicy(terminal_ttl_s=600.0, events_maxlen=1000, events_ttl_s=3600.0, max_claims=2)

MakeStore = Callable[..., Store]


@pytest.fixture(params=["memory", "redis", "cluster"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers().start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
async def make_store(
    store_kind: str, redis_server: RedisServer, request: pytest.FixtureRequest
) -> AsyncIterator[MakeStore]:
    """Factory of fresh stores of this backend (each with its own key prefix on the shared Redis).

    `make_store(policy, share=other)` opens a second store on the same data as `other` (a second
    metaserver replica on one Redis); only meaningful for Redis.
    """
    opened: list[Store] = []

    def make(policy: LedgerPolicy = POLICY, *, share: Store | None = None) -> Store:
        if share is not None:
            url = share.url
        elif store_kind == "memory":
            url = "memory://"
        elif store_kind == "cluster":
            cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
            url = cluster.url(f"t{uuid.uuid4().hex[:12]}")
        else:
            url = f"{redis_server.url}?prefix=t{uuid.uuid4().hex[:12]}"
        store = open_store(url, policy=policy)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store()

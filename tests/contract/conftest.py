"""Fixtures of the store contract suite: every fixture here is parametrized over every backend."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from pdgate.metaserver.store import LedgerPolicy, Store, open_store

from tests.support.redis import RedisServer

POLICY = LedgerPolicy(terminal_ttl_s=600.0, events_maxlen=1000, events_ttl_s=3600.0, max_claims=2)

MakeStore = Callable[..., Store]


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_store(store_kind: str, redis_server: RedisServer) -> AsyncIterator[MakeStore]:
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

"""Helpers for tests that run the metaserver: unique ids, store URLs isolated on a shared Redis, and one
client call from synchronous test code."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdgate.meta_client import MetaClient
from tests.support.redis import RedisServer

__all__ = ["store_url", "sync_meta", "uid"]

T = TypeVar("T")


def uid(prefix: str = "x") -> str:
    """A fresh id, valid as an instance or transfer id."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def store_url(kind: str, redis_server: RedisServer | None = None) -> str:
    """`memory://`, or the Redis server's URL with a key prefix of its own (isolated from other tests)."""
    if kind == "memory":
        return "memory://"
    assert redis_server is not None
    return f"{redis_server.url}?prefix=t{uuid.uuid4().hex[:12]}"


def sync_meta(url: str, fn: Callable[[MetaClient], Awaitable[T]]) -> T:
    """`fn` with a fresh client on the metaserver at `url`, run to the end: a thread-side test (the connector's
    control thread or process) checks or prepares the ledger through the same client the engines use."""

    async def run() -> T:
        async with MetaClient(url) as client:
            return await fn(client)

    return asyncio.run(run())

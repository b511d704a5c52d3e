"""Helpers for tests that run the metaserver: unique ids and store URLs isolated on a shared Redis."""

from __future__ import annotations

import uuid

from tests.support.redis import RedisServer

__all__ = ["store_url", "uid"]


def uid(prefix: str = "x") -> str:
    """A fresh id, valid as an instance or transfer id."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def store_url(kind: str, redis_server: RedisServer | None = None) -> str:
    """`memory://`, or the Redis server's URL with a key prefix of its own (isolated from other tests)."""
    if kind == "memory":
        return "memory://"
    assert redis_server is not None
    return f"{redis_server.url}?prefix=t{uuid.uuid4().hex[:12]}"

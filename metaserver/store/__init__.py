"""Stores of the metaserver's shared state; `open_store(url)` picks one by URL scheme.

`memory://` is the embedded store (one process); `redis://`, `rediss://` and `unix://` open the Redis
store on one Redis, `redis+sentinel://` (`rediss+sentinel://`) on a Sentinel-managed master and
`redis+cluster://` (`rediss+cluster://`) on a Redis Cluster (`store/redis_urls.py` reads them). Backends
are imported only when used, so the memory store needs nothing of redis-py.
"""

from __future__ import annotations

from collections.abc import Callable

from pdgate.metaserver.store.base import LedgerPolicy, Moved, Store

__all__ = ["SCHEMES", "LedgerPolicy", "Moved", "Store", "open_store"]


def _memory(url: str, policy: LedgerPolicy) -> Store:
    from pdgate.metaserver.store.memory import MemoryStore

    return MemoryStore(url, policy=policy)


def _redis(url: str, policy: LedgerPolicy) -> Store:
    from pdgate.metaserver.store.redis import RedisStore

    return RedisStore(url, policy=policy)


SCHEMES: dict[str, Callable[[str, LedgerPolicy], Store]] = {
    "memory": _memory,
    "redis": _redis,
    "rediss": _redis,
    "unix": _redis,
    "redis+sentinel": _redis,
    "rediss+sentinel": _redis,
    "redis+cluster": _redis,
    "rediss+cluster": _redis,
}


def open_store(url: str, *, policy: LedgerPolicy | None = None) -> Store:
    """A store for `url`; ValueError naming the known schemes otherwise."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    factory = SCHEMES.get(scheme)
    if factory is None:
        raise ValueError(f"unknown store URL {url!r}: expected one of {', '.join(s + '://' for s in SCHEMES)}")
    return factory(url, policy or LedgerPolicy())

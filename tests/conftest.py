"""Fixtures shared by the whole suite (kept generic: per-area fixtures go in that area's conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# UCX (under NIXL) loads its InfiniBand module wherever libibverbs is installed, and this machine class has
# it (the Mooncake wheel needs it even for TCP). On a host without RDMA devices that module's libnl
# destructor segfaults at interpreter exit (rtnl_tc_unregister in _dl_fini), which would end every pytest
# run, and every engine the tests start, with status 139 after all tests passed. No test uses RDMA.
os.environ.setdefault("UCX_MODULES", "^ib")

from tests.support.redis import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests isolate themselves by their own keys or key prefix."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """Plain URL of the shared session redis-server (tests must use their own keys on it)."""
    return redis_server.url

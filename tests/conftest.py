"""Fixtures shared by the whole suite (kept generic: per-area fixtures go in that area's conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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

"""Point: /health tells the truth: 503 with the reason while the store is unreachable or frozen, fast."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from pdgate.metaserver.settings import MetaSettings

from tests.security.conftest import start_meta
from tests.support.redis import RedisServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:  # closed even when the test left it frozen
        yield server


async def test_health_is_503_with_reason_while_redis_is_frozen_or_gone(own_redis: RedisServer) -> None:
    server = start_meta(MetaSettings(store=own_redis.url, sweep_interval_s=10, health_timeout_s=1.0))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            assert own_redis.pid is not None
            os.kill(own_redis.pid, signal.SIGSTOP)
            start = time.monotonic()
            frozen = await http.get("/health")
            took = time.monotonic() - start
            assert frozen.status_code == 503 and frozen.json()["code"] == "store_unavailable", frozen.text
            assert "1 s" in frozen.json()["detail"] and took < 3.0, (took, frozen.text)
            os.kill(own_redis.pid, signal.SIGCONT)
            own_redis.stop()
            gone = await http.get("/health")
            assert gone.status_code == 503 and "redis" in gone.json()["detail"], gone.text
            own_redis.start()
            assert (await http.get("/health")).status_code == 200
    finally:
        server.stop()

"""Points: one cursor grammar on both stores (400 before the store), and bounded long-polls.

What goes wrong without them: a cursor each store parses its own way (`99999999999999999999` is 500 on
Redis and 200 on memory; `+5` and `0-0` differ), anonymous `wait=6` polls that each hold a Redis
connection, a `wait=1` poll that hangs as long as a frozen Redis does, and an event feed created (and
kept for an hour) for every unknown instance someone polls.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store.memory import MemoryStore

from tests.security.conftest import Serve, start_meta
from tests.support.redis import RedisServer

INVALID = ["99999999999999999999", "+5", "-1", "5-", "-5", "1.5", "0x10", "zz", " 1", "1-2-3", "9007199254740992", ""]
VALID = ["0", "0-0", "5", "1764572800000-3", "9007199254740991"]


@pytest.mark.parametrize("cursor", INVALID)
async def test_invalid_cursor_is_400_on_both_stores(serve: Serve, cursor: str) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        resp = await http.get("/v1/instances/p0/handoff-events", params={"cursor": cursor})
        assert resp.status_code == 400, resp.text
        assert resp.json()["code"] == "invalid_cursor" and "query.cursor" in resp.json()["detail"]


@pytest.mark.parametrize("cursor", VALID)
async def test_valid_cursor_is_200_on_both_stores(serve: Serve, cursor: str) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        resp = await http.get("/v1/instances/p0/handoff-events", params={"cursor": cursor})
        assert resp.status_code == 200 and resp.json()["events"] == [], resp.text


async def test_long_polls_are_capped_with_429(serve: Serve) -> None:
    base = serve(max_long_polls=3).url
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        tid = (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"]
        polls = [
            asyncio.create_task(http.get(f"/v1/handoffs/{tid}", params={"wait": 2})),
            asyncio.create_task(http.get("/v1/instances/p0/handoff-events", params={"wait": 2})),
            asyncio.create_task(http.get("/v1/instances/p1/handoff-events", params={"wait": 2})),
        ]
        await asyncio.sleep(0.5)
        extra = await http.get("/v1/instances/p2/handoff-events", params={"wait": 2})
        assert extra.status_code == 429 and extra.headers["retry-after"] == "1", extra.text
        assert extra.json()["code"] == "too_many_requests"
        assert (await http.get(f"/v1/handoffs/{tid}")).status_code == 200  # a plain read is not a long-poll
        assert [r.status_code for r in await asyncio.gather(*polls)] == [200, 200, 200]
        assert (await http.get("/v1/instances/p2/handoff-events", params={"wait": 0.1})).status_code == 200


async def test_polling_an_unknown_instance_leaves_no_feed() -> None:
    async with running_service(MetaSettings(store="memory://"), sweep=False) as svc:
        store = svc.store
        assert isinstance(store, MemoryStore)
        answer = await svc.events("nobody-registered-this", None, wait=0.2)
        assert answer.events == [] and "nobody-registered-this" not in store._feeds


@pytest.fixture
def frozen_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to be frozen with SIGSTOP (never the session's shared one)."""
    with RedisServer() as server:  # closed even when the test left it frozen
        yield server


async def test_blocking_read_on_a_frozen_redis_is_bounded(frozen_redis: RedisServer) -> None:
    server = start_meta(MetaSettings(store=frozen_redis.url, sweep_interval_s=10))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert (await http.get("/v1/instances/p0/handoff-events", params={"wait": 0.1})).status_code == 200
            tid = (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"]
            assert frozen_redis.pid is not None
            os.kill(frozen_redis.pid, signal.SIGSTOP)
            for path in ("/v1/instances/p0/handoff-events", f"/v1/handoffs/{tid}"):
                start = time.monotonic()
                resp = await http.get(path, params={"wait": 1})
                took = time.monotonic() - start
                assert resp.status_code == 503 and resp.json()["code"] == "store_unavailable", resp.text
                assert took < 5.0, f"a wait=1 poll of {path} on a frozen Redis took {took:.1f} s"
    finally:
        server.stop()

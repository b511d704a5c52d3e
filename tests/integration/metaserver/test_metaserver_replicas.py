"""Two metaserver processes on one Redis behave as one; a Redis restart is survived without a restart."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.meta_client import MetaClient, MetaConflict, MetaUnavailable
from pdgate.models import HandoffCreate, HandoffState, KVLocation
from tests.support.meta import store_url, uid
from tests.support.ports import free_port
from tests.support.redis import RedisServer
from tests.support.servers import UvicornThread, wait_http

S = HandoffState
LOC = KVLocation(block_ids=[[4, 5]], num_tokens=32)


def spawn(store: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "pdgate.metaserver",
        "--port",
        str(port),
        "--store",
        store,
        "--sweep-interval-s",
        "0.05",
    ]
    env = {**os.environ, "PDGATE_LOG_LEVEL": "warning"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def two_replicas(redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    store = store_url("redis", redis_server)
    ports = [free_port(), free_port()]
    procs = [spawn(store, p) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs, strict=True):
            try:
                wait_http(url + "/health", timeout=30)
            except TimeoutError:
                proc.terminate()
                raise RuntimeError(
                    f"metaserver process did not start: {proc.communicate()[1].decode()[-2000:]}"
                ) from None
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def test_two_processes_share_one_ledger(two_replicas: tuple[str, str]) -> None:
    url_a, url_b = two_replicas
    async with MetaClient(url_a) as a, MetaClient(url_b) as b:
        tids = []
        for i in range(10):
            h = await (a if i % 2 else b).create_handoff(
                HandoffCreate(prefill_instance_id="p-shared", transfer_id=f"h{i}")
            )
            tids.append(h.transfer_id)
        with pytest.raises(MetaConflict):
            await b.create_handoff(HandoffCreate(prefill_instance_id="p-shared", transfer_id="h0"))

        # h0: created on B, ready on A, claimed by 64 racers across both, finished on the other replica.
        await a.mark_ready("h0", LOC)

        async def race(i: int) -> str | None:
            try:
                return (await (a if i % 2 else b).claim("h0", f"d{i}")).decode_instance_id
            except MetaConflict:
                return None

        winners = [w for w in await asyncio.gather(*(race(i) for i in range(64))) if w is not None]
        assert len(winners) == 1
        winner_index = int(winners[0][1:])
        finisher = b if winner_index % 2 else a
        assert (await finisher.done("h0", winners[0])).state is S.DONE

        # The rest: alternate replicas for every step, aborts and done, in a known order.
        expected = [("h0", S.DONE)]
        for i, tid in enumerate(tids[1:], start=1):
            x, y = (a, b) if i % 2 else (b, a)
            if i % 3 == 0:
                await x.abort(tid, f"abort {i}")
                expected.append((tid, S.ABORTED))
            else:
                await y.mark_ready(tid, LOC)
                await x.claim(tid, "d-one")
                await y.done(tid, "d-one")
                expected.append((tid, S.DONE))

        # One short lease, expired by whichever sweeper gets there first: exactly one EXPIRED event.
        short = await a.create_handoff(HandoffCreate(prefill_instance_id="p-shared", transfer_id="short", lease_s=0.2))
        await b.mark_ready(short.transfer_id, LOC)
        expected.append(("short", S.EXPIRED))

        async def full_feed(client: MetaClient) -> list[tuple[str, HandoffState]]:
            seen: list[tuple[str, HandoffState]] = []
            cursor = None
            while len(seen) < len(expected):
                page = await client.events("p-shared", cursor=cursor, wait=10)
                assert page.events, f"feed stalled after {seen}"
                seen += [(e.transfer_id, e.state) for e in page.events]
                cursor = page.cursor
            assert (await client.events("p-shared", cursor=cursor, wait=0.3)).events == []
            return seen

        feed_a, feed_b = await asyncio.gather(full_feed(a), full_feed(b))
        assert feed_a == feed_b == expected
        # Both feeds were read in the same order; a cursor from A resumes on B.
        first = await a.events("p-shared")
        rest = await b.events("p-shared", cursor=first.cursor) if len(first.events) < len(expected) else None
        assert rest is None or rest.events == []


async def test_redis_restart_gives_503_then_recovers_by_itself() -> None:
    with RedisServer() as redis:
        settings = MetaSettings(store=f"{redis.url}?prefix=restart", sweep_interval_s=0.05)
        with UvicornThread(create_app(settings)) as server:
            async with MetaClient(server.url, timeout=10) as meta, httpx.AsyncClient(base_url=server.url) as http:
                h = await meta.create_handoff(HandoffCreate(prefill_instance_id=uid("p")))
                await meta.mark_ready(h.transfer_id, LOC)

                redis.stop()
                with pytest.raises(MetaUnavailable) as err:
                    await meta.claim(h.transfer_id, "d0")
                assert err.value.code == "store_unavailable" and err.value.status == 503
                resp = await http.get("/health")
                assert resp.status_code == 503 and resp.json()["code"] == "store_unavailable"
                resp = await http.get("/v1/instances")
                assert resp.status_code == 503 and resp.headers["content-type"].startswith("application/problem+json")

                redis.start()  # same port, empty (no persistence): the scripts must be loaded again
                deadline = asyncio.get_running_loop().time() + 30
                while (await http.get("/health")).status_code != 200:
                    assert asyncio.get_running_loop().time() < deadline, "metaserver never recovered"
                    await asyncio.sleep(0.05)
                p = uid("p")
                h2 = await meta.create_handoff(HandoffCreate(prefill_instance_id=p))
                await meta.mark_ready(h2.transfer_id, LOC)
                await meta.claim(h2.transfer_id, "d0")
                assert (await meta.done(h2.transfer_id, "d0")).state is S.DONE
                assert [e.transfer_id for e in (await meta.events(p)).events] == [h2.transfer_id]

"""The router's client of a separate metaserver (`pdgate/meta_pooled.py`) keeps its connections under a cap:
calls past it wait for a free connection, and a call that cannot get one in time is a typed
`MetaUnavailable`. The metaserver here is a raw HTTP/1.1 server on a real socket that counts how many
connections are open at once and answers after a delay, so calls pile up."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaUnavailable
from pdgate.meta_pooled import PooledMetaClient
from tests.support.waiting import until


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


INSTANCES = _answer(b'{"instances": []}')
EVENTS = _answer(b'{"events": [], "cursor": "0-0"}')


class CountingServer:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.open = 0
        self.most_open = 0
        self.answered = 0
        self.asked = 0  # requests whose head has arrived

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")  # GETs carry no body
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.asked += 1
                await asyncio.sleep(self.delay_s)
                writer.write(EVENTS if b"handoff-events" in head.split(b"\r\n", 1)[0] else INSTANCES)
                await writer.drain()
                self.answered += 1
        finally:
            self.open -= 1
            writer.close()


async def _serve(delay_s: float) -> tuple[CountingServer, asyncio.Server, str]:
    counting = CountingServer(delay_s)
    server = await asyncio.start_server(counting.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return counting, server, f"http://127.0.0.1:{port}"


async def test_calls_past_the_cap_wait_for_a_connection_instead_of_opening_one() -> None:
    counting, server, url = await _serve(delay_s=0.02)
    pool = HttpPool()
    client = PooledMetaClient(url, pool=pool, timeout=5.0, max_connections=3)
    try:
        answers = await asyncio.gather(*(client.list_instances() for _ in range(40)))
    finally:
        await pool.aclose()
        server.close()
    assert answers == [[]] * 40 and counting.answered == 40
    assert counting.most_open <= 3  # 40 calls at once, never more than 3 connections


async def test_a_call_that_cannot_get_a_connection_in_time_is_metaserver_unavailable() -> None:
    counting, server, url = await _serve(delay_s=0.6)
    pool = HttpPool()
    client = PooledMetaClient(url, pool=pool, timeout=0.3, max_connections=1)
    try:
        # A long poll holds the one connection past the next call's timeout (its own is 0.3 s + its wait).
        first = asyncio.ensure_future(client.events("p-1", wait=2.0))
        await until(lambda: counting.asked == 1, what="the long poll at the metaserver")
        with pytest.raises(MetaUnavailable, match="all 1 connections stayed busy"):
            await client.list_instances()
        assert (await first).events == []  # the connection's holder was not disturbed
    finally:
        await pool.aclose()
        server.close()
    assert counting.most_open == 1

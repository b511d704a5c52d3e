"""http_pool.py / http1.py over real sockets: keep-alive reuse, the stale keep-alive retry, chunked streams,
timeouts and cancellation (both close the connection, which is how an engine learns to abort)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pdgate.http_pool import HttpPool
from pdgate.upstream import ConnectFailed, ConnectionClosed, ProtocolFailure, ReadTimeout
from tests.support.ports import free_port
from tests.support.servers import UvicornThread

JSON = [(b"content-type", b"application/json")]


class Echo:
    """A raw ASGI app that records client ports (connections) and disconnects."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.disconnects = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.ports.append(scope["client"][1])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path == "/hang":
            if (await receive())["type"] == "http.disconnect":
                self.disconnects += 1
            return
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for i in range(50):
                await send({"type": "http.response.body", "body": b"%d," % i * 2000, "more_body": True})
            await send({"type": "http.response.body", "body": b"end", "more_body": False})
            return
        if path == "/slow":  # progress every 0.1 s for 1 s: longer than the reader's timeout, never idle that long
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for i in range(10):
                await asyncio.sleep(0.1)
                await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
            await send({"type": "http.response.body", "body": b"end", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-echo", b"yes")]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[str, Echo]]:
    app = Echo()
    with UvicornThread(app) as server:
        yield server.url, app


@pytest.fixture
async def pool() -> AsyncIterator[HttpPool]:
    p = HttpPool(connect_timeout=2)
    yield p
    await p.aclose()


async def test_keep_alive_reuses_one_connection(pool: HttpPool, echo: tuple[str, Echo]) -> None:
    url, app = echo
    app.ports.clear()
    for i in range(5):
        resp = await pool.request("POST", url + "/x", JSON, b'{"n": %d}' % i)
        assert resp.status == 201 and resp.header(b"x-echo") == b"yes"
        assert await resp.read() == b'{"n": %d}' % i
    assert len(set(app.ports)) == 1


async def test_chunked_body_streams_in_pieces(pool: HttpPool, echo: tuple[str, Echo]) -> None:
    url, _ = echo
    resp = await pool.request("GET", url + "/stream", [], b"")
    parts = []
    while (chunk := await resp.next_chunk(5)) is not None:
        parts.append(chunk)
    data = b"".join(parts)
    assert data.endswith(b"end") and len(data) == sum(len(b"%d," % i * 2000) for i in range(50)) + 3


async def wait_for(check: Any) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not reached")


async def test_timeout_and_cancellation_close_the_connection(pool: HttpPool, echo: tuple[str, Echo]) -> None:
    url, app = echo
    before = app.disconnects
    with pytest.raises(ReadTimeout):
        await pool.request("POST", url + "/hang", JSON, b"{}", timeout=0.2)
    await wait_for(lambda: app.disconnects == before + 1)
    seen = len(app.ports)
    task = asyncio.create_task(pool.request("POST", url + "/hang", JSON, b"{}"))
    await wait_for(lambda: len(app.ports) == seen + 1)  # the request reached the server
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: app.disconnects == before + 2)


async def test_the_read_timeout_counts_from_the_last_progress_not_the_first_wait(
    pool: HttpPool, echo: tuple[str, Echo]
) -> None:
    """A connection keeps one timer for its waits (http1.py): each chunk must push the deadline on."""
    url, _ = echo
    resp = await pool.request("GET", url + "/slow", [], b"", timeout=0.6)
    assert await resp.read(timeout=0.6) == b"0,1,2,3,4,5,6,7,8,9,end"


async def test_a_short_timeout_after_a_long_one_on_the_same_connection_still_fires(
    pool: HttpPool, echo: tuple[str, Echo]
) -> None:
    """The connection's timer, set for the first request's 60 s, must not make the second wait 60 s."""
    url, app = echo
    resp = await pool.request("POST", url + "/x", JSON, b"{}", timeout=60)
    assert await resp.read(timeout=60) == b"{}"
    with pytest.raises(ReadTimeout, match=r"no answer within 0\.2 s"):
        await asyncio.wait_for(pool.request("POST", url + "/hang", JSON, b"{}", timeout=0.2), 20)
    assert app.ports[-1] == app.ports[-2]  # the same keep-alive connection served both


async def test_connect_failure_is_typed(pool: HttpPool) -> None:
    with pytest.raises(ConnectFailed):
        await pool.request("GET", f"http://127.0.0.1:{free_port()}/", [], b"")


async def serve_raw(handler: Any) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def test_a_keep_alive_connection_closed_by_the_server_is_retried_once(pool: HttpPool) -> None:
    """First connection: answer one request, then close on the next without answering (the idle-timeout
    race). The pool must resend that request on a fresh connection."""
    conns = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        first = conns == 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await writer.drain()
        if first:
            await reader.readuntil(b"\r\n\r\n")  # the second request arrives ...
        writer.close()  # ... and the connection closes without an answer

    server, url = await serve_raw(handler)
    async with server:
        for _ in range(2):
            resp = await pool.request("GET", url + "/", [], b"")
            assert await resp.read() == b"ok"
    assert conns == 2


async def test_a_truncated_body_is_an_error_not_a_short_answer(pool: HttpPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
        await writer.drain()
        writer.close()

    server, url = await serve_raw(handler)
    async with server:
        resp = await pool.request("GET", url + "/", [], b"")
        with pytest.raises(ConnectionClosed):
            await resp.read()


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:99999/", "http://" + "a" * 64 + ":8000/", "http://[::1/", "ftp://127.0.0.1:21/"],
)
async def test_an_unusable_instance_url_is_a_connect_failure(pool: HttpPool, url: str) -> None:
    """Whatever a registered URL makes the socket layer raise (ValueError, OverflowError, UnicodeError)
    is that instance's failure to connect, which the proxy retries elsewhere, never a bare exception."""
    with pytest.raises(ConnectFailed):
        await pool.request("GET", url, [], b"", timeout=2)


async def test_an_engine_that_switches_protocols_is_a_protocol_failure(pool: HttpPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    server, url = await serve_raw(handler)
    async with server:
        with pytest.raises(ProtocolFailure, match="switched protocols"):
            await pool.request("GET", url + "/", [], b"", timeout=2)


def test_a_connection_refused_before_the_request_went_out_is_a_typed_failure() -> None:
    """A server that answers 503 and closes as soon as it accepts (the metaserver past `max_connections`):
    the pool must report a typed `ConnectionClosed`, never write to the closed transport (uvloop, the
    router's loop, raises RuntimeError there; at 4,096 streams the router reported
    `metaserver unreachable: RuntimeError`)."""
    import uvloop

    class Refuse(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:  # uvloop's transport is no asyncio.Transport
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            transport.close()

    async def scenario() -> set[str]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Refuse, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = HttpPool(connect_timeout=2)
        connect = pool._connect

        async def late_connect(origin: Any) -> Any:
            # The refusal and the close arrive before the pool writes, as when the event loop is busy.
            conn = await connect(origin)
            for _ in range(100):
                if conn.closed:
                    break
                await asyncio.sleep(0.01)
            return conn

        pool._connect = late_connect  # type: ignore[method-assign]
        seen: set[str] = set()
        try:
            for _ in range(5):
                try:
                    resp = await pool.request("POST", f"http://127.0.0.1:{port}/v1/handoffs", JSON, b"{}", timeout=10)
                    seen.add(f"status {resp.status}")
                    resp.close()
                except ConnectionClosed:
                    seen.add("ConnectionClosed")
        finally:
            await pool.aclose()
            server.close()
        return seen

    assert uvloop.run(scenario()) == {"ConnectionClosed"}

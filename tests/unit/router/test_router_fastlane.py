"""fastlane.py's cycle against uvicorn's, for what an app can do wrong or big: real uvicorn, real sockets.

Each case runs under the guarded protocol with the lane (`with_fast_lane`) and without it, and must end
the same: an app that raises or returns without answering gets uvicorn's plain 500, an invalid header
closes the connection, a large answer to a slow reader arrives whole (the transport pauses writing and
`send` waits), a body split over several packets reaches the app once, and a second `receive()` hears
of the client's disconnect.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pdgate.router.app import render_openai
from pdgate.router.fastlane import LaneCycle, with_fast_lane

from pdgate.serving import ServerLimits, guarded_protocol
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread, receive_body

SERVERS: dict[int, UvicornThread] = {}
BIG = bytes(range(256)) * (128 * 1024)  # 32 MiB: far more than the socket buffers hold


class App:
    """POST /<case>: what the case says; records the bodies it got, the cycle it ran on, and disconnects."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.cycles: list[str] = []
        self.disconnects = 0
        self.waiting = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.cycles.append(type(getattr(receive, "__self__", None)).__name__)
        body = await receive_body(receive)
        self.bodies.append(body)
        case = scope["path"].strip("/")
        if case == "raise":
            raise RuntimeError("a bug")
        if case == "silent":
            return
        if case == "bad-header":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"a\r\nb")]})
            return
        if case == "wait":  # the next message is the disconnect
            self.waiting.set()
            if (await receive())["type"] == "http.disconnect":
                self.disconnects += 1
            return
        if case == "big":
            hdrs = [(b"content-length", str(len(BIG)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": hdrs})
            await send({"type": "http.response.body", "body": BIG})
            return
        if case == "stream":  # no length: chunked, in many pieces
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(0, len(BIG), 65536):
                await send({"type": "http.response.body", "body": BIG[i : i + 65536], "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        hdrs = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=[True, False], ids=["lane", "uvicorn"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[App, int, bool]]:
    app = App()
    protocol = guarded_protocol(ServerLimits(), render_openai)
    if request.param:
        protocol = with_fast_lane(protocol, lambda method, url: method == b"POST")
    with UvicornThread(app, http=protocol) as server:
        SERVERS[server.port] = server
        yield app, server.port, request.param
        del SERVERS[server.port]


def exchange(port: int, raw: bytes | list[bytes], *, slow: bool = False) -> bytes:
    """Send `raw` (pieces: one send each), then read until the server closes or an answer is whole; when
    `slow`, read only once the server's transport has paused writing (the reader is behind)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        for piece in raw if isinstance(raw, list) else [raw]:
            sock.sendall(piece)
        if slow:
            conns = SERVERS[port].server.server_state.connections
            wait_until(lambda: any(c.flow.write_paused for c in list(conns)), what="the server paused writing")
        data = b""
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return data
            data += chunk
            if _whole(data):
                return data


def _whole(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")


def request(case: str, body: bytes = b"{}") -> bytes:
    return f"POST /{case} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            return out
        out, body = out + body[:size], body[size + 2 :]


def test_the_lane_really_serves_the_requests(served: tuple[App, int, bool]) -> None:
    app, port, lane = served
    answer = exchange(port, request("echo", b"hello"))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nhello")
    assert app.cycles == ([LaneCycle.__name__] if lane else ["RequestResponseCycle"])


@pytest.mark.parametrize("case", ["raise", "silent"])
def test_an_app_that_raises_or_answers_nothing_gets_uvicorns_plain_500(
    served: tuple[App, int, bool], case: str
) -> None:
    _, port, _ = served
    answer = exchange(port, request(case))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 Internal Server Error") and body == b"Internal Server Error"
    assert b"connection: close" in head


def test_an_invalid_header_closes_the_connection_without_an_answer(served: tuple[App, int, bool]) -> None:
    _, port, _ = served
    assert exchange(port, request("bad-header")) == b""


def test_a_body_in_several_packets_reaches_the_app_once(served: tuple[App, int, bool]) -> None:
    app, port, _ = served
    body = b"x" * 50_000
    raw = request("echo", body)
    pieces = [raw[:30], raw[30:10_000], raw[10_000:30_000], raw[30_000:]]
    answer = exchange(port, pieces)
    assert answer.endswith(body) and app.bodies == [body]


@pytest.mark.parametrize("case", ["big", "stream"])
def test_a_large_answer_to_a_slow_reader_arrives_whole(served: tuple[App, int, bool], case: str) -> None:
    _, port, _ = served
    answer = exchange(port, request(case), slow=True)
    head, _, body = answer.partition(b"\r\n\r\n")
    if case == "stream":
        assert b"transfer-encoding: chunked" in head
        body = dechunk(body)
    assert hashlib.sha256(body).digest() == hashlib.sha256(BIG).digest()


def test_a_second_receive_hears_the_disconnect(served: tuple[App, int, bool]) -> None:
    app, port, _ = served
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(request("wait"))
    wait_until(app.waiting.is_set, what="the app waits on its second receive()")
    sock.close()
    wait_until(lambda: app.disconnects == 1, what="the disconnect heard")


def test_answered_requests_leave_no_task_behind(served: tuple[App, int, bool]) -> None:
    """uvicorn waits for `server_state.tasks` at shutdown: each lane task leaves it when it ends."""
    _, port, _ = served
    tasks = SERVERS[port].server.server_state.tasks
    for _ in range(3):
        assert exchange(port, request("echo")).startswith(b"HTTP/1.1 200")
    wait_until(lambda: not tasks, what="no task left")

"""protocol.py: a proxied request hears of its client's disconnect from the router's HTTP protocol, with
no task of its own, and through a pending `receive()` under any other server. Real uvicorn, real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pdgate.router.app import render_openai
from pdgate.router.protocol import EXTENSION, Watch, watching_protocol

from pdgate.serving import ServerLimits, guarded_protocol
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread, receive_body

WATCHED = "/watched"


class App:
    """POST /watched and POST /plain: read the body, watch for a disconnect, then hang (`/hang` in the
    body) or answer at once. Records, per request, whether the scope had the hook and what happened."""

    def __init__(self) -> None:
        self.hooked: list[bool] = []
        self.disconnects = 0
        self.tasks_at_start: list[int] = []
        self.started = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await receive_body(receive)
        self.hooked.append(EXTENSION in (scope.get("extensions") or {}))
        task = asyncio.current_task()
        before = len(asyncio.all_tasks())

        def gone() -> None:
            self.disconnects += 1
            assert task is not None
            task.cancel()

        watch = Watch(scope, receive, gone)
        self.tasks_at_start.append(len(asyncio.all_tasks()) - before)  # tasks the watch itself started
        try:
            if body == b"hang":
                self.started.set()
                await asyncio.Event().wait()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            watch.stop()


@pytest.fixture
def served() -> Iterator[tuple[App, str]]:
    app = App()
    protocol = watching_protocol(guarded_protocol(ServerLimits(), render_openai), frozenset({WATCHED}))
    with UvicornThread(app, http=protocol) as server:
        yield app, server.url


def _post(url: str, path: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    sock.sendall(head + body)
    return sock


@pytest.mark.parametrize("path,hooked", [(WATCHED, True), ("/plain", False)])
def test_a_client_that_goes_away_is_heard_of_once_with_or_without_the_hook(
    served: tuple[App, str], path: str, hooked: bool
) -> None:
    app, url = served
    sock = _post(url, path, b"hang")
    wait_until(app.started.is_set, what="request started")
    assert app.hooked == [hooked]
    assert app.tasks_at_start == [0 if hooked else 1]  # the hook needs no watcher task
    sock.close()
    wait_until(lambda: app.disconnects == 1, what="disconnect heard")


def test_answered_requests_on_a_keep_alive_connection_are_never_reported_as_disconnects(
    served: tuple[App, str],
) -> None:
    app, url = served
    sock = _post(url, WATCHED, b"quick")
    for i in range(3):
        data = b""
        while not data.endswith(b"ok"):
            data += sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 200")
        if i < 2:
            sock.sendall(f"POST {WATCHED} HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nquick".encode())
    sock.close()
    host, port = url.removeprefix("http://").split(":")
    # One more request on a fresh connection proves the server went on; none of the three was a disconnect.
    with socket.create_connection((host, int(port))) as probe:
        probe.sendall(f"POST {WATCHED} HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nquick".encode())
        assert probe.recv(4096).startswith(b"HTTP/1.1 200")
    assert app.hooked == [True] * 4 and app.disconnects == 0


def test_the_fallback_watch_reports_a_disconnect_message_and_stops_quietly() -> None:
    async def scenario() -> tuple[int, int]:
        heard = [0, 0]
        gate: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

        async def receive() -> dict[str, Any]:
            return await gate

        w = Watch({}, receive, lambda: heard.__setitem__(0, heard[0] + 1))
        gate.set_result({"type": "http.disconnect"})
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        stopped = Watch({}, receive, lambda: heard.__setitem__(1, heard[1] + 1))
        stopped.stop()
        await asyncio.sleep(0)
        w.stop()
        return heard[0], heard[1]

    assert asyncio.run(scenario()) == (1, 0)

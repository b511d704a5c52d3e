"""Real HTTP servers for tests: an ASGI app served by uvicorn in a thread, or a subprocess.

`UvicornThread(app)` serves over a real socket on a free loopback port with its own event loop, so the
test's loop acts as a separate client. `wait_http(url)` polls until a URL answers (no fixed sleeps).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import uvicorn

from tests.support.ports import free_port

__all__ = ["UvicornThread", "wait_http"]


def wait_http(url: str, *, timeout: float = 15.0, status: int | None = 200) -> httpx.Response:
    """GET `url` until it answers (with `status`, unless None); TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(url, timeout=1.0)
            if status is None or resp.status_code == status:
                return resp
            last = resp.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.02)
    raise TimeoutError(f"{url} did not answer {status} within {timeout} s (last: {last!r})")


class UvicornThread:
    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int | None = None, **config: Any) -> None:
        self.host = host
        self.port = port or free_port(host)
        cfg = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on", **config)
        self.server = uvicorn.Server(cfg)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> UvicornThread:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> UvicornThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def receive_body(receive: Any) -> bytes:
    """The whole request body of a test ASGI app (every `http.request` message until `more_body` is off)."""
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    return body

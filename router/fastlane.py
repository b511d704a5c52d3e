"""The server's fast lane: simple requests to the hot routes run on a lean ASGI cycle instead of uvicorn's.

Why: per request, uvicorn builds a `RequestResponseCycle` with its `asyncio.Event`, wraps the app in a
coroutine, runs two regular expressions per response header and writes the head and the body with two
`transport.write` calls, which uvloop sends as two syscalls (`/proc/<pid>/io`: 5 writes per proxied
request in bench/router.py's isolated mode, 4 with the lane). A proxied request, and an engine's ledger
call to the embedded metaserver, is always the same simple shape (a body with a Content-Length,
keep-alive, no `Expect`), so for that shape the protocol (`with_fast_lane`, a subclass of uvicorn's
httptools protocol) keeps the body itself and, once it is complete, starts the app on a `LaneCycle`.
Measured (docs/COMPARISON.md): serving one small POST costs 21.7 us of CPU under the guarded protocol
and 20.1 us with the lane (bench/router_libs.py `server_cpu`); the router's CPU per request drops 3-7%
without streaming (isolated and embedded modes of bench/router.py); py-spy's share for uvicorn's
`send` and task start, 19% at c=32 embedded, is mostly the socket writes, which every server pays.

- the app is the same ASGI app (`scope`, `receive`, `send`): every feature above the server (auth,
  validation, typed errors, retries, breaker, metrics, the ledger record, the disconnect hook of
  `protocol`) runs unchanged; only the server's half of the cycle is leaner;
- the task starts once, when the body is complete, straight on the app (no wrapper coroutine; a done
  callback does what uvicorn's wrapper does: a plain 500 when nothing was sent, a close when a response
  was cut);
- a response with a Content-Length goes out as one write of head and body; one without is chunked (SSE
  streams); header names and values are checked with one regular expression each per response;
- flow control (`pause_writing`: `send` waits for the transport to drain), keep-alive (`Connection:
  close`, HTTP/1.0 and server shutdown end the connection after the answer), pipelining (a request that
  arrives while one is answered waits on uvicorn's own queue) and the guard of `pdgate.serving` (header
  and body timeouts, early 413, connection cap: it sits above this class) behave as on uvicorn's cycle.

Anything else takes uvicorn's path unchanged: another method or route, a query string or an escaped path,
a chunked body, `Expect: 100-continue`, an upgrade, HTTP/1.0, uvicorn's `limit_concurrency`, a
request behind one still being answered. uvicorn's access log, when on, gets the same line from the
lane. The integration suite runs through the lane (`tests/integration/router`), and
tests/integration/router/test_router_fast_lane.py sets its answers beside uvicorn's for the same requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

from pdgate.asgi import ACCESS_NOTE

__all__ = ["LaneCycle", "with_fast_lane"]

log = logging.getLogger("uvicorn.error")

_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error"
)


class _Defaults:
    """uvicorn's default response headers (`date`, `server`) as bytes, re-rendered when uvicorn replaces
    the list (once a second, for the date)."""

    __slots__ = ("rendered", "source")

    def __init__(self) -> None:
        self.source: object = None
        self.rendered = b""

    def get(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not self.source:
            self.rendered = b"".join(n + b": " + v + b"\r\n" for n, v in headers)
            self.source = headers
        return self.rendered


_DEFAULTS = _Defaults()


class LaneCycle:
    """One request on the fast lane: its body, then its response, with the attributes uvicorn's protocol
    and the guard read on a `RequestResponseCycle` (`disconnected`, `response_started`, `response_complete`,
    `keep_alive`, `message_event.set()`), so that their code works on either."""

    __slots__ = (
        "_head",
        "_remaining",
        "_waiter",
        "body",
        "chunked",
        "disconnected",
        "keep_alive",
        "more_body",
        "on_response",
        "proto",
        "response_complete",
        "response_started",
        "running",
        "scope",
    )

    def __init__(self, proto: HttpToolsProtocol, scope: dict[str, Any], keep_alive: bool) -> None:
        self.proto = proto
        self.scope = scope
        self.keep_alive = keep_alive
        self.body: list[bytes] = []
        self.more_body: bool | None = True  # None: the body was given to the app
        self.running = False
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self._remaining = 0
        self._head = b""
        self._waiter: asyncio.Future[None] | None = None
        self.on_response: Callable[[], None] = proto.on_response_complete

    @property
    def message_event(self) -> LaneCycle:
        """uvicorn sets the cycle's event on a disconnect: here that wakes a pending `receive()`."""
        return self

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the app's side ------------------------------------------------------------------------
    async def receive(self) -> dict[str, Any]:
        if not self.disconnected and self.more_body is False:
            self.more_body = None  # given
            parts, self.body = self.body, []
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            return {"type": "http.request", "body": body, "more_body": False}
        # The body was given: like uvicorn, the next message is the disconnect (or the response's end).
        if not self.disconnected and not self.response_complete:
            self._waiter = self.proto.loop.create_future()
            await self._waiter
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        proto = self.proto
        if proto.flow.write_paused and not self.disconnected:
            await proto.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.chunked:
            out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                out += b"0\r\n\r\n"
        else:
            self._remaining -= len(body)
            if self._remaining < 0:
                raise RuntimeError("Response content longer than Content-Length")
            out = self._head + body if self._head else body
            self._head = b""
        if out:
            proto.transport.write(out)
        if not more:
            if self._remaining:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.set()
            if not self.keep_alive:
                proto.transport.close()
            self.on_response()

    def _start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """The status line and headers, as uvicorn writes them; held for the first body write unless chunked."""
        self.response_started = True
        proto = self.proto
        if proto.access_log:
            scope: Any = self.scope
            # What the router decided (`pd:long_prompt`, `whole:ledger_unavailable`) ends the message, outside
            # the arguments: uvicorn's own access formatter takes exactly these five.
            note = scope.get(ACCESS_NOTE)
            fmt = '%s - "%s %s HTTP/%s" %d' + (" " + note.replace("%", "%%") if note else "")
            proto.access_logger.info(fmt, get_client_addr(scope), scope["method"], scope["path"], "1.1", status)
        parts = [STATUS_LINE[status], _DEFAULTS.get(proto.server_state.default_headers)]
        names: list[bytes] = []
        values: list[bytes] = []
        length: int | None = None
        has_close = False
        for name, value in headers:
            name = name.lower()
            names.append(name)
            values.append(value)
            if name == b"content-length":
                if length is None and not self.chunked:
                    length = int(value)
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked" and length is None:
                    self.chunked = True
            elif name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
                self.keep_alive = False
                has_close = True
            parts += (name, b": ", value, b"\r\n")
        if HEADER_RE.search(b"".join(names)):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        if not self.keep_alive and not has_close:
            parts.append(b"connection: close\r\n")
        if length is None and not self.chunked and status not in (204, 304):
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        if self.chunked:
            proto.transport.write(head)
        else:
            self._remaining = length or 0
            self._head = head

    # -- the server's side ---------------------------------------------------------------------
    def run(self, app: Callable[..., Any]) -> None:
        """The body is complete: start the app (one task, nothing wrapped around it)."""
        self.running = True
        task: asyncio.Task[None] = self.proto.loop.create_task(app(self.scope, self.receive, self.send))
        self.proto.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """What uvicorn's `run_asgi` does after the app returned or raised."""
        proto = self.proto
        proto.tasks.discard(task)
        self.on_response = _nothing
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            log.error("Exception in ASGI application\n", exc_info=exc)
        elif self.response_complete or self.disconnected:
            return
        elif self.response_started:
            log.error("ASGI callable returned without completing response.")
        else:
            log.error("ASGI callable returned without starting response.")
        if self.disconnected or proto.transport.is_closing():
            return
        if not self.response_started:
            self.response_started = self.response_complete = True
            proto.transport.write(_500)
        proto.transport.close()


def _nothing() -> None:
    return None


def with_fast_lane(base: type[HttpToolsProtocol], lane: Callable[[bytes, bytes], bool]) -> type[HttpToolsProtocol]:
    """`base` (uvicorn's httptools protocol or a subclass, e.g. `pdgate.serving`'s guard) with a fast
    lane for the requests with a body whose method and raw path `lane(method, path)` accepts. The lane sits
    right above uvicorn's class, so the subclasses' checks (the guard's timeouts and 413) run first, as
    they do for every request."""

    class FastLane(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            url: bytes = self.url
            parser = self.parser
            method: bytes = parser.get_method()
            if not (
                lane(method, url)
                and url.isascii()
                and b"?" not in url
                and b"%" not in url
                and not self.expect_100_continue
                and parser.get_http_version() == "1.1"
                and not parser.should_upgrade()
                and self.limit_concurrency is None
                and not self.config.reset_contextvars
                and (self.cycle is None or self.cycle.response_complete)
                and _plain_length(self.headers)
            ):
                super().on_headers_complete()
                return
            scope: Any = self.scope
            path = url.decode("ascii")
            scope["method"] = method.decode("ascii")
            scope["path"] = self.root_path + path
            scope["raw_path"] = self.root_path.encode("ascii") + url
            scope["query_string"] = b""
            self.cycle = LaneCycle(self, scope, parser.should_keep_alive())  # type: ignore[assignment]

        def on_body(self, body: bytes) -> None:
            cycle: Any = self.cycle
            if type(cycle) is LaneCycle and not cycle.running:
                cycle.body.append(body)  # bounded: the guard refused a Content-Length over the limit
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            cycle: Any = self.cycle
            if type(cycle) is LaneCycle and not cycle.running:
                cycle.more_body = False
                cycle.run(self.app)
                return
            super().on_message_complete()

    if base is HttpToolsProtocol:
        return FastLane
    return type(f"FastLane{base.__name__}", (base, FastLane), {})


def _plain_length(headers: list[tuple[bytes, bytes]]) -> bool:
    """A Content-Length body and no Transfer-Encoding: the only body the lane reads."""
    length = False
    for name, _ in headers:
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            return False
    return length

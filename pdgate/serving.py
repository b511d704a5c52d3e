"""Connection hygiene for pdgate's HTTP services: slow clients are cut off, greedy ones refused early.

Why a protocol subclass: uvicorn bounds nothing before the application runs. A connection that sends no
bytes, trickles its headers or declares a body it never sends is held forever (only an idle keep-alive
connection is timed out), and `limit_concurrency` is checked after the headers arrived, so a thousand
silent connections pass it. The checks belong where the bytes arrive, in the HTTP protocol object, so
`guarded_protocol()` subclasses uvicorn's httptools protocol (passed to uvicorn as `http=`):

- headers: a timer starts when a connection opens (and when a keep-alive connection starts its next
  request) and is cancelled when the headers are complete; when it fires the client gets 408 and the
  connection is closed;
- body: while a declared body is being received, each chunk re-arms a timer; a body that stalls that
  long gets 408 (the application sees a disconnect, and anything it sends later is dropped) and the
  connection is closed. A pause caused by the server (flow control: the application has not read what
  arrived) does not count as the client's stall;
- size: a `Content-Length` over `max_body_bytes` gets 413 at once, before any of the body is read,
  and the connection is closed; a chunked body is bounded by the application while it reads;
- head: a URL over `max_url_bytes` gets 414 and a request head (request line and headers) over
  `max_header_bytes` gets 431, counted as the bytes arrive, before the head is complete. Why in bytes
  and not only in time: the parser joins a header's bytes chunk by chunk (a cost that grows with the
  square of its size), so a 32 MB header sent at full speed held the loop for seconds within the header
  timeout, and was then served. nginx, Envoy and h11 refuse past a few tens of KB; so do we;
- connections: past `max_connections` open connections a new one gets 503 with `Retry-After: 1` and is
  closed before any byte is read. Why not uvicorn's `limit_concurrency`: it counts only after reading
  the headers (a slow client still holds a slot) and cannot say Retry-After. Why 503 and not a reset:
  clients and load balancers retry a 503 elsewhere; a reset looks like a crash.

Every refusal is an answer the client can read, never a bare close or a reset: the server writes it,
half-closes, and keeps reading (and dropping) whatever the client still sends until the client closes or
one more header timeout has passed. Why so long: the client that times out is often not malicious but
starved (a load generator on a busy machine connected, then did not run for 30 s); when it wakes it
sends its request, and a socket we had already closed would answer that with a reset, which the client
reports as an untyped connection error instead of the 408 it is owed (bench/chaos_scale.py found this
at 4,096 streams on 2 busy cores). A silent attacker holds a slot at most twice the header timeout.

Each service renders the refusals in its own error shape (`Render`): RFC 7807 on the metaserver,
OpenAI error JSON on the router.

    config = uvicorn.Config(app, host=..., port=..., http=guarded_protocol(limits, render))
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdgate.errors import CODES, Code

__all__ = ["Render", "ServerLimits", "guarded_protocol", "plain_text"]

_LINGER_S = 1.0

# (code, detail) -> (content type, body); the status comes from the code's entry in pdgate.errors.CODES.
Render = Callable[[Code, str], tuple[bytes, bytes]]


def plain_text(code: Code, detail: str) -> tuple[bytes, bytes]:
    return b"text/plain; charset=utf-8", f"{code.value}: {detail}\n".encode()


@dataclass(frozen=True)
class ServerLimits:
    """What a client may take from a server; see the module docstring for what each bound does."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_connections: int = 4096
    max_header_bytes: int = 64 << 10  # request line and headers together (nginx's large buffers: 4 x 8 KiB)
    max_url_bytes: int = 8 << 10  # the request target (nginx: one 8 KiB buffer; h11: its head limit)


def _raw_response(code: Code, render: Render, detail: str, extra: list[bytes] | None = None) -> bytes:
    status = CODES[code].status
    ctype, body = render(code, detail)
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode(),
        b"content-type: " + ctype + b"\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n",
        *(extra or []),
        b"\r\n",
    ]
    return b"".join(head) + body


@dataclass(frozen=True)
class _Policy:
    limits: ServerLimits
    render: Render


# What the connection's one deadline is for.
_NOTHING, _IDLE, _HEADERS, _BODY = 0, 1, 2, 3


class _Guarded(HttpToolsProtocol):
    """The guard. Its timers are one deadline per connection (`_time`): a request that arrives whole costs
    a few clock reads and no timer. Why: arming and cancelling a timer per phase (headers, body, and
    uvicorn's keep-alive) was three timers per request, measured at about a fifth of what serving a small
    request costs (bench/router_libs.py, `guardonly` against `raw`)."""

    policy: ClassVar[_Policy]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when `_timer` fires
        self._phase = _NOTHING
        self._deadline = 0.0
        self._refused = False
        self._in_head = True  # from a request's first byte until its headers are complete
        self._head_bytes = 0  # bytes read while `_in_head`

    # -- the deadline ---------------------------------------------------------------------------
    def _time(self, phase: int, seconds: float) -> None:
        """`phase` ends in `seconds`. The one timer moves only when this deadline is earlier than it fires;
        when it fires early it looks again (`_fire`)."""
        deadline = self.loop.time() + seconds
        self._phase = phase
        self._deadline = deadline
        timer = self._timer
        if timer is None or deadline < self._timer_at:
            if timer is not None:
                timer.cancel()
            self._timer_at = deadline
            self._timer = self.loop.call_at(deadline, self._fire)

    def _disarm(self) -> None:
        self._phase = _NOTHING
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        phase = self._phase
        if phase == _NOTHING:
            return
        if self.loop.time() < self._deadline:  # the deadline moved on since the timer was set
            self._timer_at = self._deadline
            self._timer = self.loop.call_at(self._deadline, self._fire)
            return
        self._phase = _NOTHING
        self._expired(phase)

    def _expired(self, phase: int) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if phase == _IDLE:  # uvicorn's keep-alive timeout: an idle connection is closed
            self.transport.close()
            return
        if phase == _BODY:
            if self.flow is not None and self.flow.read_paused:  # the application is behind, not the client
                self._time(_BODY, self.policy.limits.body_timeout_s)
                return
            detail = f"request body stalled for {self.policy.limits.body_timeout_s:g} s"
            cycle = self.cycle
            if cycle is not None and cycle.response_started:  # too late for an answer of our own
                self.logger.info("closing a connection whose %s", detail)
                self.transport.close()
                return
            if cycle is not None:  # the application sees a disconnect; whatever it sends is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            self._refuse(Code.REQUEST_TIMEOUT, detail)
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request waits for the answer in progress (uvicorn stopped reading): not its fault.
            self._time(_HEADERS, self.policy.limits.header_timeout_s)
            return
        detail = f"request headers not received within {self.policy.limits.header_timeout_s:g} s"
        self._refuse(Code.REQUEST_TIMEOUT, detail)

    def _refuse(self, code: Code, detail: str, extra: list[bytes] | None = None) -> None:
        """Answer `code` straight on the socket (no application involved) and close the connection."""
        self._refused = True
        self._disarm()
        self.transport.write(_raw_response(code, self.policy.render, detail, extra))
        if self.transport.can_write_eof():
            # Half-close, and keep reading until the client closes (or a header timeout passes): closing
            # with request bytes still to come would reset the connection, and the client would lose the
            # answer it is owed (see the module docstring).
            self.transport.write_eof()
            self.loop.call_later(max(_LINGER_S, self.policy.limits.header_timeout_s), self.transport.close)
        else:
            self.transport.close()

    # -- protocol events -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.policy.limits.max_connections:
            detail = f"this server holds at most {self.policy.limits.max_connections} connections; retry shortly"
            self._refuse(Code.SERVER_BUSY, detail, [b"retry-after: 1\r\n"])
            return
        self._time(_HEADERS, self.policy.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase == _IDLE:  # a keep-alive connection's next request: timed from its first byte
            self._time(_HEADERS, self.policy.limits.header_timeout_s)
        super().data_received(data)
        if self._in_head and not self._refused:
            # Counted after the parser took the chunk: a chunk that completes the head is not counted, one
            # that does not is all head. The parser reads at most one chunk past the limit.
            self._head_bytes += len(data)
            if self._head_bytes > self.policy.limits.max_header_bytes:
                detail = f"request head over the limit of {self.policy.limits.max_header_bytes} bytes"
                self._refuse(Code.HEADERS_TOO_LARGE, detail)

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._in_head = True
        self._head_bytes = 0
        super().on_message_begin()
        if self._phase == _NOTHING:  # a request pipelined behind one in progress
            self._time(_HEADERS, self.policy.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        if len(self.url) + len(url) > self.policy.limits.max_url_bytes:
            self._refuse(Code.URL_TOO_LONG, f"URL over the limit of {self.policy.limits.max_url_bytes} bytes")
            return
        super().on_url(url)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._phase = _NOTHING
        declared = self._declared_length()
        if declared is not None and declared > self.policy.limits.max_body_bytes:
            detail = f"body of {declared} bytes is over the limit of {self.policy.limits.max_body_bytes} bytes"
            self._refuse(Code.BODY_TOO_LARGE, detail)
            return
        super().on_headers_complete()
        if (declared or self._chunked()) and not self.transport.is_closing():
            self._time(_BODY, self.policy.limits.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        super().on_body(body)
        if self._phase == _BODY:
            self._time(_BODY, self.policy.limits.body_timeout_s)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        if self._phase == _BODY:
            self._phase = _NOTHING
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """uvicorn's, with its keep-alive timer replaced by the connection's deadline (`_time`)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._phase == _NOTHING and not self._refused:  # (a next request already begun keeps its clock)
            self._time(_IDLE, self.timeout_keep_alive)

    # -- helpers ------------------------------------------------------------------------------
    def _declared_length(self) -> int | None:
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None  # the parser refuses it with 400 itself
        return None

    def _chunked(self) -> bool:
        return any(n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in self.headers)


def guarded_protocol(limits: ServerLimits, render: Render = plain_text) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class (for `uvicorn.Config(http=...)`) that applies `limits`."""
    return type("GuardedHttpToolsProtocol", (_Guarded,), {"policy": _Policy(limits, render)})

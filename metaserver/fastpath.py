"""FastPath: the ledger's hot routes served by a lean ASGI handler in front of the FastAPI app.

Why: a full handoff is four HTTP calls (create, ready, claim, done), and at thousands of handoffs per
second FastAPI's per-request machinery (middleware stack, route scan, dependency solving) costs more
CPU than the ledger itself. The routes served here are the rows of `routes.ROUTES` marked `fast`, matched
exactly on their path segments (`Route.match`), and each runs the row's own `run`, the function its
FastAPI route runs, after the same steps (`guards.AccessGuard`, the bounded body, RFC 7807 errors via
`errors.py`, the latency metric under the same route template), so answers are identical; the
integration suite runs against the app with and without it. A request with a query string (a
long-poll's `?wait=`) and every other path falls through to FastAPI, which also answers the 404s and
405s. The FastAPI routes remain the documented and mountable surface (`api.build_router`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdgate.metaserver.api import error_from_exception
from pdgate.metaserver.errors import PROBLEM_MEDIA_TYPE, AdminTokenRequired, BodyTooLarge, InvalidInput, problem_body
from pdgate.metaserver.guards import AccessGuard, LongPolls
from pdgate.metaserver.routes import ROUTES, Call, Route
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings

__all__ = ["FAST_ROUTES", "FastPath", "match"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = b"application/json"
_PROBLEM = PROBLEM_MEDIA_TYPE.encode()
_PREFIX = "/v1/handoffs"

# The rows of `routes.ROUTES` served here, in its order.
FAST_ROUTES: tuple[Route, ...] = tuple(r for r in ROUTES if r.fast)
assert all(r.path.startswith(_PREFIX) for r in FAST_ROUTES), "the fast path's quick reject assumes this prefix"


class _ClientGone(Exception):
    """The client disconnected while sending its body: nothing to answer."""


def match(method: str, path: str, query: bytes) -> tuple[Route, dict[str, str]] | None:
    """The fast row `method path` is, exactly (no query string: long-polls go to FastAPI), with its path
    parameters; None: FastAPI answers (another route, a 404, a 405)."""
    if query or not path.startswith(_PREFIX):
        return None
    parts = path.split("/")
    for route in FAST_ROUTES:
        params = route.match(method, parts)
        if params is not None:
            return route, params
    return None


class FastPath:
    def __init__(self, app: ASGIApp, get_service: Callable[[], MetaService], settings: MetaSettings) -> None:
        self.app = app
        self.get_service = get_service
        self.settings = settings
        self.guard = AccessGuard(settings)
        self.long_polls = LongPolls(settings.max_long_polls)  # never held here: long-polls go to FastAPI
        self.limit = settings.max_body_bytes
        self._observers: dict[tuple[int, str, str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        matched = match(scope["method"], scope["path"], scope.get("query_string", b""))
        if matched is None:
            await self.app(scope, receive, send)
            return
        route, params = matched
        start = time.perf_counter()
        svc = self.get_service()
        headers = [(b"content-type", _JSON)]
        try:
            auth, declared = "", None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    auth = value.decode("latin-1")
                elif name == b"content-length":
                    declared = value
            client = scope.get("client")
            engine = self.guard.check(auth, client[0] if client else None, write=route.write, admin=route.admin)
            raw = await self._read(receive, declared) if route.write else b""
            call = Call(svc, self.settings, self.long_polls, params, raw, {}, engine)
            model, status = await route.run(call)
            if model is None:
                body = b""
            else:
                body = model if type(model) is bytes else model.__pydantic_serializer__.to_json(model)  # type: ignore[union-attr]
        except _ClientGone:
            return
        except Exception as exc:
            err = error_from_exception(exc)
            status, body = err.status, problem_body(err, instance=scope["path"])
            headers = [(b"content-type", _PROBLEM)]
            if isinstance(err, AdminTokenRequired):
                headers.append((b"www-authenticate", b"Bearer"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        metric = svc.metrics.request_latency
        key = (id(metric), scope["method"], route.path, status)
        child = self._observers.get(key)
        if child is None:
            child = self._observers[key] = metric.labels(scope["method"], route.path, str(status))
        child.observe(time.perf_counter() - start)

    async def _read(self, receive: Receive, declared: bytes | None) -> bytes:
        """The body, bounded like api.read_body: 413 on a large Content-Length or a large stream."""
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise InvalidInput(f"header.content-length: {declared!r} is not a number") from None
            if size > self.limit:
                raise BodyTooLarge(f"body of {size} bytes is over the limit of {self.limit} bytes")
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                raise BodyTooLarge(f"body is over the limit of {self.limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks) if len(chunks) != 1 else chunks[0]

"""FastPath: the ledger's hot routes served by a lean ASGI handler in front of the FastAPI app.

Why: a full handoff is four HTTP calls (create, ready, claim, done), and at thousands of handoffs per
second FastAPI's per-request machinery (middleware stack, route scan, dependency solving) costs more
CPU than the ledger itself. These routes are matched by splitting the path, and run the very same
steps as the FastAPI routes in `api.py` (admin token, bounded body, `api.parse_body`, `MetaService`,
RFC 7807 errors via `errors.py`, latency metric under the same route template), so answers are
identical; the integration suite runs against the app with and without it. `POST /v1/handoffs/batch`
is served here too, by the same `batch.py` functions as its FastAPI route. Everything else (and
`GET /v1/handoffs/{id}` with a query, i.e. long-polls) falls through to FastAPI. The FastAPI routes
remain the documented and mountable surface (`api.build_router`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdgate.metaserver.api import error_from_exception, parse_body
from pdgate.metaserver.batch import BATCH_ROUTE, parse_batch, render_batch, run_batch
from pdgate.metaserver.errors import PROBLEM_MEDIA_TYPE, AdminTokenRequired, BodyTooLarge, InvalidInput, problem_body
from pdgate.metaserver.guards import AccessGuard
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings

from pdgate.models import AbortBody, ClaimBody, DoneBody, HandoffCreate, KVLocation

__all__ = ["FastPath"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = b"application/json"
_PROBLEM = PROBLEM_MEDIA_TYPE.encode()


class _ClientGone(Exception):
    """The client disconnected while sending its body: nothing to answer."""


async def _create(svc: MetaService, _tid: str, raw: bytes) -> tuple[Any, int]:
    body = parse_body(raw, HandoffCreate)
    assert body is not None
    return await svc.create_handoff(body), 201


async def _ready(svc: MetaService, tid: str, raw: bytes) -> tuple[Any, int]:
    body = parse_body(raw, KVLocation)
    assert body is not None
    return await svc.mark_ready(tid, body), 200


async def _claim(svc: MetaService, tid: str, raw: bytes) -> tuple[Any, int]:
    body = parse_body(raw, ClaimBody)
    assert body is not None
    return await svc.claim(tid, body.decode_instance_id, body.lease_s), 200


async def _done(svc: MetaService, tid: str, raw: bytes) -> tuple[Any, int]:
    body = parse_body(raw, DoneBody, optional=True)
    return await svc.done(tid, body.decode_instance_id if body else None), 200


async def _abort(svc: MetaService, tid: str, raw: bytes) -> tuple[Any, int]:
    body = parse_body(raw, AbortBody, optional=True)
    return await svc.abort(tid, body.reason if body else AbortBody().reason), 200


class _Raw:
    """A body already rendered (a batch's results)."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body


async def _batch(svc: MetaService, _tid: str, raw: bytes) -> tuple[Any, int]:
    items = parse_batch(raw)
    return _Raw(render_batch(items, await run_batch(svc, items))), 200


async def _get(svc: MetaService, tid: str, _raw: bytes) -> tuple[Any, int]:
    return await svc.get_handoff(tid), 200


Handler = Callable[[MetaService, str, bytes], Awaitable[tuple[Any, int]]]
# (method, last path segment) -> (route template as in api.py, handler, is a write)
_ACTIONS: dict[tuple[str, str], tuple[str, Handler, bool]] = {
    ("PUT", "ready"): ("/v1/handoffs/{transfer_id}/ready", _ready, True),
    ("POST", "claim"): ("/v1/handoffs/{transfer_id}/claim", _claim, True),
    ("POST", "done"): ("/v1/handoffs/{transfer_id}/done", _done, True),
    ("POST", "abort"): ("/v1/handoffs/{transfer_id}/abort", _abort, True),
}
_CREATE = ("/v1/handoffs", _create, True)
_GET = ("/v1/handoffs/{transfer_id}", _get, False)
_BATCH = (BATCH_ROUTE, _batch, True)


def _match(method: str, path: str, query: bytes) -> tuple[tuple[str, Handler, bool], str] | None:
    if not path.startswith("/v1/handoffs"):
        return None
    parts = path.split("/")  # ['', 'v1', 'handoffs', tid, action]
    if len(parts) == 3:
        return (_CREATE, "") if method == "POST" else None
    if len(parts) == 4:
        if method == "POST" and parts[3] == "batch":
            return _BATCH, ""
        return (_GET, parts[3]) if method == "GET" and not query and parts[3] else None
    if len(parts) == 5 and parts[3]:
        found = _ACTIONS.get((method, parts[4]))
        return (found, parts[3]) if found else None
    return None


class FastPath:
    def __init__(self, app: ASGIApp, get_service: Callable[[], MetaService], settings: MetaSettings) -> None:
        self.app = app
        self.get_service = get_service
        self.guard = AccessGuard(settings)
        self.limit = settings.max_body_bytes
        self._observers: dict[tuple[int, str, str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        matched = _match(scope["method"], scope["path"], scope.get("query_string", b""))
        if matched is None:
            await self.app(scope, receive, send)
            return
        (route, handler, write), tid = matched
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
            self.guard.check(auth, client[0] if client else None, write=write)
            raw = await self._read(receive, declared) if write else b""
            model, status = await handler(svc, tid, raw)
            body = model.body if type(model) is _Raw else model.__pydantic_serializer__.to_json(model)
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
        key = (id(metric), scope["method"], route, status)
        child = self._observers.get(key)
        if child is None:
            child = self._observers[key] = metric.labels(scope["method"], route, str(status))
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

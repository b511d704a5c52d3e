"""One proxied request: pair -> handoff -> prefill -> decode -> relay; abort on every way out.

The flow, in order:
 1. admission (hop header, API key, in-flight bound, body size), parse and validate, resolve the model;
 2. choose a prefill among eligible instances that have an eligible compatible decode (prefill policy);
 3. mint a `transfer_id`, create the handoff (PENDING) naming that prefill;
 4. send the prefill copy of the body (`bodies.prefill_body`); a failure or timeout aborts that handoff
    and starts again at 2 on another prefill with a new transfer id (bounded by `prefill_retries`);
 5. choose a decode that can take this prefill's KV (decode policy), send it the client's body with the
    prefill's `kv_transfer_params`; a failure before anything was sent to the client retries another
    decode with the same handoff (no second prefill), bounded by `decode_retries`;
 6. answer: a JSON answer whole once it is checked, a stream chunk by chunk (`streaming.relay_stream`).
Steps 2-6 are `attempts.Dispatcher`; the request's state is one `request_flow.ProxiedRequest`.
An engine's 4xx is the client's error: relayed verbatim, not retried. Everything else that goes wrong is
a typed `PDError`. A client that disconnects cancels the request's task (the watcher on `receive`):
upstream connections are aborted (so the engines abort), and the handoff is aborted in the background
so the prefill frees its blocks at once instead of waiting for a lease.

Hot path: raw ASGI, one background future per request (the disconnect watcher), no per-request
allocation of policy or pool objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from random import Random
from time import perf_counter
from typing import Any

from pdgate.metaserver.client import MetaAPI
from pdgate.router.access import ClientKeys
from pdgate.router.asgi import Message, Receive, Scope, Send
from pdgate.router.attempts import Dispatcher
from pdgate.router.bodies import parse_json, request_facts
from pdgate.router.errors import (
    BadRequest,
    ModelNotFound,
    NoCompatiblePair,
    Overloaded,
    PayloadTooLarge,
    PDError,
    RouterError,
    Unauthorized,
    UpstreamRejected,
)
from pdgate.router.logs import transfer_id as log_transfer_id
from pdgate.router.loops import HOP_HEADER, LoopDetected
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Policy
from pdgate.router.pool import Pool
from pdgate.router.request_flow import ProxiedRequest, mint_transfer_id
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import send_error
from pdgate.router.upstream import Upstream
from pdgate.router.validation import validate_request

__all__ = ["Proxy"]

log = logging.getLogger(__name__)

_FORWARD = frozenset({b"traceparent", b"tracestate"})


class Proxy:
    """The ASGI handler of POST /v1/completions and POST /v1/chat/completions."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        pool: Pool,
        meta: Callable[[], MetaAPI],
        upstream: Callable[[], Upstream],
        metrics: RouterMetrics,
        prefill_policy: Policy,
        decode_policy: Policy,
        engine_metaserver: str | None,
        rng: Random,
        clock: Callable[[], float],
    ) -> None:
        s = settings
        self._pool = pool
        self._m = metrics
        self._dispatch = Dispatcher(
            s,
            pool=pool,
            meta=meta,
            upstream=upstream,
            metrics=metrics,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            engine_metaserver=engine_metaserver,
            rng=rng,
            clock=clock,
        )
        self._client_keys = ClientKeys(s.api_key)
        self._forward_auth = s.forward_client_auth
        self._max_inflight = s.max_inflight
        self._max_body = s.max_body_bytes
        self._prefix_chars = s.prefix_chars
        self.inflight = 0
        self._outcomes: dict[tuple[str, str], Any] = {}

    # -- ASGI entry ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        endpoint: str = scope["path"]
        auth = rid = None
        hop = False
        extra: list[tuple[bytes, bytes]] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"x-request-id":
                rid = value
            elif name in _FORWARD:
                extra.append((name, value))
            elif name == HOP_HEADER:
                hop = True
        tid = mint_transfer_id()
        req = ProxiedRequest(endpoint, tid, rid or tid.encode(), auth if self._forward_auth else None, extra)
        try:
            if hop:
                raise LoopDetected(
                    "this request was already forwarded by a pdgate router: an instance URL points at a router"
                )
            if self._client_keys.enabled and not self._client_keys.allows(auth):
                raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
            if self.inflight >= self._max_inflight:
                raise Overloaded(f"{self.inflight} requests in flight (limit {self._max_inflight}); retry later")
            raw = await _read_body(receive, self._max_body)
        except RouterError as exc:
            await self._reply_error(send, req, exc)
            return
        self.inflight += 1
        token = log_transfer_id.set(tid)
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(partial(_on_receive, req, task))
        outcome = "ok"
        try:
            outcome = await self._serve(req, raw, send, start)
        except asyncio.CancelledError:
            if not req.disconnected:
                raise
            uncancel = getattr(task, "uncancel", None)  # 3.11+: this cancellation was ours and ends here
            if uncancel is not None:
                uncancel()
            outcome = "client_disconnected"
            req.abort_reason = "client_disconnected"
            log.info("client disconnected; upstream requests cancelled")
        except Exception as exc:  # a bug: still an OpenAI error body, never a bare 500
            log.exception("unexpected error in the proxy")
            outcome = "internal_error"
            if not req.started:
                await self._reply_error(send, req, RouterError(f"internal router error: {type(exc).__name__}"))
        finally:
            self.inflight -= 1
            req.finished = True
            if not watcher.done():
                watcher.cancel()
            if req.live is not None:
                self._dispatch.abort(req, req.abort_reason)
            self._count(endpoint, outcome)
            log_transfer_id.reset(token)
        self._m.e2e.observe(perf_counter() - start)

    def _count(self, endpoint: str, outcome: str) -> None:
        key = (endpoint, outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self._m.requests.labels(endpoint, outcome)
        child.inc()

    async def _reply_error(self, send: Send, req: ProxiedRequest, err: RouterError) -> None:
        if not isinstance(err, UpstreamRejected):
            self._m.error(err.code.value)
            level = logging.WARNING if isinstance(err, PDError) else logging.INFO
            log.log(level, "%s: %s", err.code.value, err.message)
        await send_error(send, err, [(b"x-request-id", req.rid)], req.end)

    # -- the flow -----------------------------------------------------------------------------

    async def _serve(self, req: ProxiedRequest, raw: bytes, send: Send, start: float) -> str:
        try:
            body = parse_json(raw)
            validate_request(body, req.endpoint)
            req.body = body
            req.facts = request_facts(body, req.endpoint, self._prefix_chars)
            model = self._resolve_model(req.facts.model)
            req.overhead_s = perf_counter() - start  # the rest of the time is waiting for engines
            await self._dispatch.prefill(req, model)
            return await self._dispatch.decode(req, send)
        except RouterError as exc:
            await self._reply_error(send, req, exc)
            return exc.code.value

    def _resolve_model(self, model: str | None) -> str:
        pool = self._pool
        if model is not None:
            if model in pool.prefills or model in pool.decodes:
                return model
            if not pool.instances:
                raise NoCompatiblePair("no prefill or decode instance is registered")
            raise ModelNotFound(f"The model `{model}` does not exist.")
        known = pool.known_models()
        if len(known) == 1:
            return known[0]
        if not known:
            raise NoCompatiblePair("no prefill or decode instance is registered")
        raise BadRequest(f"'model' is required: this router serves {', '.join(known)}")

    async def drain_background(self, timeout: float = 5.0) -> None:
        """Wait for the handoff aborts still in flight (at shutdown)."""
        await self._dispatch.drain_background(timeout)


def _on_receive(req: ProxiedRequest, task: asyncio.Task[Any] | None, fut: asyncio.Future[Message]) -> None:
    """Disconnect watcher: a client that goes away before the response ended cancels the request."""
    if fut.cancelled() or fut.exception() is not None:
        return
    if fut.result().get("type") == "http.disconnect" and not req.finished and task is not None:
        req.disconnected = True
        task.cancel()


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise BadRequest("client disconnected while sending the body")
        chunk = msg.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body over the limit of {limit} bytes")
            parts.append(chunk)
        if not msg.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)

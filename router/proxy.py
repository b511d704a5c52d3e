"""One proxied request: pair -> handoff -> prefill -> decode -> relay; abort on every way out.

The flow, in order:
 1. admission (API key, in-flight bound, body size), parse, resolve the model;
 2. choose a prefill among eligible instances that have an eligible compatible decode (prefill policy);
 3. mint a `transfer_id`, create the handoff (PENDING) naming that prefill;
 4. send the prefill copy of the body (`bodies.prefill_body`); a failure or timeout aborts that handoff
    and starts again at 2 on another prefill with a new transfer id (bounded by `prefill_retries`);
 5. choose a decode that can take this prefill's KV (decode policy), send it the client's body with the
    prefill's `kv_transfer_params`; a failure before its first body byte retries another decode with the
    same handoff (no second prefill), bounded by `decode_retries`;
 6. relay: a stream chunk by chunk (`streaming.relay_stream`), a JSON answer whole.
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

from pdgate.metaserver.client import MetaAPI, MetaConflict, MetaError, MetaGone, MetaNotFound
from pdgate.router.access import ClientKeys
from pdgate.router.attempts import Attempts
from pdgate.router.bodies import decode_body, decode_params, parse_json, request_facts
from pdgate.router.errors import (
    BadRequest,
    DecodeFailed,
    ModelNotFound,
    NoCompatiblePair,
    Overloaded,
    PayloadTooLarge,
    PDError,
    RouterError,
    Unauthorized,
    UpstreamRejected,
    UpstreamTimeout,
)
from pdgate.router.logs import transfer_id as log_transfer_id
from pdgate.router.loops import HOP_HEADER, LoopDetected
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Policy
from pdgate.router.pool import Pool
from pdgate.router.request_flow import _MAX_ANSWER, _Flow, mint_transfer_id
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import relay_stream, send_body, send_error
from pdgate.router.upstream import ReadTimeout, Upstream, UpstreamError
from pdgate.router.validation import validate_request

__all__ = ["Proxy", "mint_transfer_id"]

log = logging.getLogger(__name__)

_FORWARD = frozenset({b"traceparent", b"tracestate"})


class Proxy(Attempts):
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
        self._meta = meta
        self._upstream = upstream
        self._m = metrics
        self._p_policy = prefill_policy
        self._d_policy = decode_policy
        self._engine_meta = engine_metaserver
        self._rng = rng
        self._clock = clock
        self._keys = [k.encode() for k in s.api_key]
        self._client_keys = ClientKeys(s.api_key)
        self._forward_auth = s.forward_client_auth
        self._upstream_auth = f"Bearer {s.upstream_api_key}".encode() if s.upstream_api_key else None
        self._max_inflight = s.max_inflight
        self._max_body = s.max_body_bytes
        self._prefix_chars = s.prefix_chars
        self._p_attempts = 1 + s.prefill_retries
        self._d_attempts = 1 + s.decode_retries
        self._backoff = (s.retry_backoff_s, s.retry_backoff_max_s)
        self._p_timeout = s.prefill_timeout_s
        self._d_timeout = s.decode_timeout_s
        self._idle_timeout = s.stream_idle_timeout_s
        self._lease = s.handoff_lease_s
        self.inflight = 0
        self._bg: set[asyncio.Task[None]] = set()
        self._retry_children = {side: metrics.retries.labels(side) for side in ("prefill", "decode")}
        self._outcomes: dict[tuple[str, str], Any] = {}

    # -- ASGI entry ---------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
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
        flow = _Flow(tid, rid or tid.encode(), auth if self._forward_auth else None, extra)
        try:
            if hop:
                raise LoopDetected(
                    "this request was already forwarded by a pdgate router: an instance URL points at a router"
                )
            if self._keys:
                self._check_key(auth)
            if self.inflight >= self._max_inflight:
                raise Overloaded(f"{self.inflight} requests in flight (limit {self._max_inflight}); retry later")
            raw = await _read_body(receive, self._max_body)
        except RouterError as exc:
            await self._reply_error(send, flow, exc, endpoint)
            return
        self.inflight += 1
        token = log_transfer_id.set(tid)
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(partial(_on_receive, flow, task))
        outcome = "ok"
        try:
            outcome = await self._serve(flow, endpoint, raw, send, start)
        except asyncio.CancelledError:
            if not flow.disconnected:
                raise
            uncancel = getattr(task, "uncancel", None)  # 3.11+: this cancellation was ours and ends here
            if uncancel is not None:
                uncancel()
            outcome = "client_disconnected"
            flow.abort_reason = "client_disconnected"
            log.info("client disconnected; upstream requests cancelled")
        except Exception as exc:  # a bug: still an OpenAI error body, never a bare 500
            log.exception("unexpected error in the proxy")
            outcome = "internal_error"
            if not flow.started:
                err = RouterError(f"internal router error: {type(exc).__name__}")
                await self._reply_error(send, flow, err, endpoint)
        finally:
            self.inflight -= 1
            flow.finished = True
            if not watcher.done():
                watcher.cancel()
            if flow.live is not None:
                self._abort(flow, flow.abort_reason)
            self._count(endpoint, outcome)
            log_transfer_id.reset(token)
        self._m.e2e.observe(perf_counter() - start)

    def _check_key(self, auth: bytes | None) -> None:
        if self._client_keys.allows(auth):
            return
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")

    def _count(self, endpoint: str, outcome: str) -> None:
        key = (endpoint, outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self._m.requests.labels(endpoint, outcome)
        child.inc()

    async def _reply_error(self, send: Callable, flow: _Flow, err: RouterError, endpoint: str) -> None:
        if not isinstance(err, UpstreamRejected):
            self._m.error(err.code)
            level = logging.WARNING if isinstance(err, PDError) else logging.INFO
            log.log(level, "%s: %s", err.code, err.message)
        await send_error(send, err, [(b"x-request-id", flow.rid)], flow.end)

    # -- the flow -----------------------------------------------------------------------------

    async def _serve(self, flow: _Flow, endpoint: str, raw: bytes, send: Callable, start: float) -> str:
        waited = 0.0
        try:
            body = parse_json(raw)
            validate_request(body, endpoint)
            facts = request_facts(body, endpoint, self._prefix_chars)
            model = self._resolve_model(facts.model)
            t = perf_counter()
            kv = await self._prefill_phase(flow, endpoint, body, facts, model)
            waited += perf_counter() - t
            d_body = decode_body(body, decode_params(kv, flow.tid, flow.kv_key, self._engine_meta))
            t = perf_counter()
            d, resp, first = await self._decode_phase(flow, endpoint, d_body, facts)
            waited += perf_counter() - t
        except RouterError as exc:
            await self._reply_error(send, flow, exc, endpoint)
            return exc.code
        self._m.overhead.observe(max(0.0, perf_counter() - start - waited))
        tokens = facts.prompt_tokens + facts.max_tokens
        ok: bool | None = None
        try:
            headers = [
                (b"content-type", resp.header(b"content-type") or b"application/json"),
                (b"x-request-id", flow.rid),
            ]
            if facts.stream:
                flow.started = True
                error = await relay_stream(send, resp, first, headers, self._idle_timeout, flow.end)
                ok = error is None
                if error is not None:
                    flow.abort_reason = "decode_stream_broke"
                    self._m.error(error.code)
                    log.warning("%s after the stream started (decode %s): %s", error.code, d.id, error.message)
                    return error.code
            else:
                try:
                    data = await resp.read(timeout=self._idle_timeout, limit=_MAX_ANSWER)
                except UpstreamError as exc:
                    ok = False
                    flow.abort_reason = "decode_failed"
                    err: RouterError = (
                        UpstreamTimeout(f"decode {d.id} went silent: {exc}")
                        if isinstance(exc, ReadTimeout)
                        else DecodeFailed(f"decode {d.id} failed while sending its answer: {exc}")
                    )
                    await self._reply_error(send, flow, err, endpoint)
                    return err.code
                ok = True
                flow.live = None
                flow.started = True
                await send_body(send, resp.status, headers, data, flow.end)
            flow.live = None
            return "ok"
        finally:
            resp.close()
            self._pool.end(d, tokens)
            if ok is not None:
                self._pool.record(d, ok, self._clock())

    def _resolve_model(self, model: str | None) -> str:
        pool = self._pool
        if model is not None:
            if model in pool.prefills or model in pool.decodes:
                return model
            if not pool.trackers:
                raise NoCompatiblePair("no prefill or decode instance is registered")
            raise ModelNotFound(f"The model `{model}` does not exist.")
        known = pool.known_models()
        if len(known) == 1:
            return known[0]
        if not known:
            raise NoCompatiblePair("no prefill or decode instance is registered")
        raise BadRequest(f"'model' is required: this router serves {', '.join(known)}")

    # -- aborts ---------------------------------------------------------------------------------

    def _abort(self, flow: _Flow, reason: str) -> None:
        """Abort the live handoff in the background: the client's answer never waits for it."""
        tid = flow.live
        if tid is None:
            return
        flow.live = None
        self._m.aborts.labels(reason).inc()
        task = asyncio.get_running_loop().create_task(self._abort_now(tid, reason))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _abort_now(self, tid: str, reason: str) -> None:
        try:
            await self._meta().abort(tid, reason)
        except (MetaConflict, MetaGone, MetaNotFound):
            pass  # already DONE, ABORTED or EXPIRED: nothing left to free
        except MetaError as exc:
            log.warning("could not abort handoff %s (%s): %s", tid, reason, exc.detail)

    async def drain_background(self, timeout: float = 5.0) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)


def _on_receive(flow: _Flow, task: asyncio.Task[Any] | None, fut: asyncio.Future[Any]) -> None:
    """Disconnect watcher: a client that goes away before the response ended cancels the request."""
    if fut.cancelled() or fut.exception() is not None:
        return
    if fut.result().get("type") == "http.disconnect" and not flow.finished and task is not None:
        flow.disconnected = True
        task.cancel()


async def _read_body(receive: Callable, limit: int) -> bytes:
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

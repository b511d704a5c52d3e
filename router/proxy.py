"""One proxied request: pair -> handoff -> prefill -> decode -> relay; abort on every way out.

The flow, in order:
 1. admission (hop header, API key, in-flight bound, body size), parse and validate, refuse what PD
    cannot serve (`validation.check_pd_support`), resolve the model, refuse what its max_model_len
    forbids (`validation.check_context`, the length from `model_cards`); a completion with several
    prompts becomes one PD request per prompt from here on (`fanout`);
 2. choose a prefill among eligible instances that have an eligible compatible decode (prefill policy);
 3. mint a `transfer_id`, create the handoff (PENDING) naming that prefill;
 4. send the prefill copy of the body (`bodies.prefill_body`); a failure or timeout aborts that handoff
    and starts again at 2 on another prefill with a new transfer id (bounded by `prefill_retries`);
 5. choose a decode that can take this prefill's KV (decode policy), send it the client's body with the
    prefill's `kv_transfer_params`; a failure before anything was sent to the client retries another
    decode with the same handoff (no second prefill), bounded by `decode_retries`;
 6. answer: a JSON answer whole once it is checked, a stream chunk by chunk (`streaming.relay_stream`),
    with what the prefill's answer adds (true `cached_tokens`, `prompt_logprobs`: `answers`).
Steps 2-6 are `attempts.Dispatcher`; the request's state is one `request_flow.ProxiedRequest`.
Before step 2, `whole.Whole.choose` decides whole or PD (the ledger down, a colocated pool); PD that fails
before a byte reached the client goes whole (`Whole.fallback`), and a stream that breaks after it is
resumed on another instance (`Whole.resume`): a fault costs latency, not an error (issue #24). With
`--otlp-traces-endpoint` the request is one span with a child span per phase (`tracing`).
An engine's 4xx is the client's error: relayed verbatim, not retried. Everything else that goes wrong is
a typed `PDError`. A client that disconnects cancels the request's task (`protocol.Watch`):
upstream connections are aborted (so the engines abort), and the handoff is aborted in the background
so the prefill frees its blocks at once instead of waiting for a lease.

Hot path: raw ASGI, no background task per request under the router's own server (the disconnect comes
from its protocol: `protocol`), no per-request allocation of policy or pool objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from functools import partial
from random import Random
from time import perf_counter
from typing import Any

from pdgate.router.access import ClientKeys
from pdgate.router.answers import PatchingSend, PrefillFacts, decode_recomputes, prefill_facts
from pdgate.router.attempts import Dispatcher
from pdgate.router.bodies import CHAT, COMPLETIONS, SplicedBody, parse_json, request_facts, split_prompts
from pdgate.router.decider import SLO_HEADERS, slo_from_headers
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
    detail,
)
from pdgate.router.fanout import admit, fan_out
from pdgate.router.first_token import FirstToken, decode_body, eligible, first_event, read
from pdgate.router.left_out import unpooled
from pdgate.router.loops import HOP_HEADER, LoopDetected
from pdgate.router.metrics import RouterMetrics
from pdgate.router.model_cards import ModelCards
from pdgate.router.policies import Policy
from pdgate.router.pool import Pool
from pdgate.router.protocol import Watch
from pdgate.router.request_flow import ProxiedRequest, mint_transfer_id
from pdgate.router.resume import StreamTrack
from pdgate.router.settings import RouterSettings
from pdgate.router.stock_mooncake import StockMooncake
from pdgate.router.streaming import end_stream, send_error
from pdgate.router.tracing import TRACE_HEADERS, Tracing, trace_context
from pdgate.router.validation import check_context, check_pd_support, validate_request
from pdgate.router.whole import Whole

from pdgate.asgi import Message, Receive, Scope, Send
from pdgate.logs import transfer_id as log_transfer_id
from pdgate.meta_client import MetaAPI
from pdgate.upstream import Upstream

__all__ = ["Proxy"]

log = logging.getLogger(__name__)

_FORWARD = TRACE_HEADERS


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
        cards: ModelCards,
        tracing: Tracing | None = None,
        claim_key: bytes | None = None,
    ) -> None:
        s = settings
        self._pool = pool
        self._m = metrics
        self._cards = cards
        self._tracing = tracing
        dispatcher = partial(
            Dispatcher,
            pool=pool,
            meta=meta,
            upstream=upstream,
            metrics=metrics,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            engine_metaserver=engine_metaserver,
            rng=rng,
            clock=clock,
            claim_key=claim_key,
        )
        self._dispatch = dispatcher(s)
        self._whole = Whole(
            s,
            pool=pool,
            upstream=upstream,
            metrics=metrics,
            headers=self._dispatch.headers,
            pause=self._dispatch.pause,
            clock=clock,
            rng=rng,
            cached_tokens=getattr(decode_policy, "cached_tokens", None),
            policy=decode_policy,
            prefill_policy=prefill_policy,
        )
        self._dispatch.resume = self._whole.resume
        self._mooncake = None
        if s.kv_protocol == "mooncake":  # vLLM's MooncakeConnector: P and D at once, the pair is retried
            decoder = dispatcher(s.model_copy(update={"decode_retries": 0}))
            decoder.resume = self._whole.resume
            self._mooncake = StockMooncake(
                s,
                decoder=decoder,
                pool=pool,
                upstream=upstream,
                metrics=metrics,
                prefill_policy=prefill_policy,
                rng=rng,
                clock=clock,
            )
        self._resumable = s.max_resumes > 0
        self._client_keys = ClientKeys(s.api_key)
        self._forward_auth = s.forward_client_auth
        self._max_inflight = s.max_inflight
        self._max_fan_out = s.max_fan_out
        self._max_body = s.max_body_bytes
        self._prefix_chars = s.prefix_chars
        self._first_token = s.first_token_from_prefill
        self._first_tokens = metrics.first_token
        self.inflight = 0
        self._outcomes: dict[tuple[str, str], Any] = {}

    # -- ASGI entry ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        endpoint: str = scope["path"]
        auth = rid = None
        hop = False
        extra: list[tuple[bytes, bytes]] = []
        slo: dict[str, str] | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"x-request-id":
                rid = value
            elif name in _FORWARD:
                extra.append((name, value))
            elif name == HOP_HEADER:
                hop = True
            elif name in SLO_HEADERS:
                slo = slo or {}
                slo[name.decode()] = value.decode("latin-1")
        if extra:  # only a well-formed trace context goes on to the engines
            extra, dropped = trace_context(extra)
            if dropped:
                self._m.trace_dropped.inc()
        tid = mint_transfer_id()
        req = ProxiedRequest(endpoint, tid, rid or tid.encode(), auth if self._forward_auth else None, extra)
        req.notes = scope
        if slo is not None:
            req.slo = slo_from_headers(slo)
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
        watch = Watch(scope, receive, partial(_on_disconnect, req, task))
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
        except Exception as exc:  # a bug: still an OpenAI error body (or event), never a bare 500 or a cut stream
            log.exception("unexpected error in the proxy")
            outcome = "internal_error"
            err = RouterError(f"internal router error: {type(exc).__name__}")
            if not req.started:
                await self._reply_error(send, req, err)
            elif not req.finished and req.facts.stream:  # a started stream ends with the typed error event
                self._m.error(err.code.value)
                with contextlib.suppress(Exception):  # the client may be gone, or the answer already ended
                    await end_stream(send, err, req.end)
        finally:
            self.inflight -= req.weight
            req.finished = True
            watch.stop()
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
            log.log(level, "%s: %s", err.code.value, detail(err))
        await send_error(send, err, [(b"x-request-id", req.rid)], req.end)

    # -- the flow -----------------------------------------------------------------------------

    async def _serve(self, req: ProxiedRequest, raw: bytes, send: Send, start: float) -> str:
        try:
            body = parse_json(raw)
            validate_request(body, req.endpoint)
            check_pd_support(body)
            req.body = body
            req.facts = request_facts(body, req.endpoint, self._prefix_chars)
            model = self._resolve_model(req.facts.model)
            limit = req.limit = await self._cards.max_model_len(model)
            if limit is not None:
                check_context(body, req.endpoint, limit)
            parts = split_prompts(body) if req.endpoint == COMPLETIONS else None
            req.weight = admit(body, parts, self.inflight - 1, self._max_inflight, self._max_fan_out)
        except RouterError as exc:
            await self._reply_error(send, req, exc)
            return exc.code.value
        self.inflight += req.weight - 1  # counted as one at the entry; it holds prompts x n engine requests
        req.asked_ids = body.get("return_token_ids") is True
        if self._resumable and req.facts.stream:  # the router tracks the ids the client gets (`resume`)
            body["return_token_ids"] = True
        req.overhead_s = perf_counter() - start  # the rest of the time is waiting for engines
        if self._tracing is None:
            return await self._prompts(req, model, send, parts)
        attributes = {
            "pdgate.transfer_id": req.tid,
            "gen_ai.request.model": model,
            "pdgate.prompts": len(parts) if parts else 1,
        }
        with self._tracing.request(req.endpoint, req.extra, attributes) as span:
            outcome = await self._prompts(req, model, send, parts)
            span.set_attribute("pdgate.outcome", outcome)
            return outcome

    async def _prompts(self, req: ProxiedRequest, model: str, send: Send, parts: list[dict[str, Any]] | None) -> str:
        if parts is None:
            if self._first_token:
                req.first_token = eligible(req.body, completions=req.endpoint == COMPLETIONS, max_model_len=req.limit)
            return await self._one(req, model, send)
        children = []
        spliced = SplicedBody.fan_out(req.body, req.body["prompt"])  # what the prompts share, encoded once
        for i, part in enumerate(parts):
            child = ProxiedRequest(
                req.endpoint, mint_transfer_id(), req.rid + f".{i}".encode(), req.client_auth, req.extra
            )
            child.body = part
            child.spliced = spliced[i]
            child.facts = request_facts(part, req.endpoint, self._prefix_chars)
            child.overhead_s = req.overhead_s
            child.notes = req.notes
            child.asked_ids = req.asked_ids
            children.append(child)
        n = req.body.get("n") or 1
        return await fan_out(
            lambda child, out: self._one(child, model, out),
            children,
            send,
            req,
            lambda child: self._dispatch.abort(child, child.abort_reason),
            n,
        )

    async def _one(self, req: ProxiedRequest, model: str, send: Send) -> str:
        """One prompt, whole or PD (`Whole.choose`: the one decision). PD that fails before a byte reached
        the client goes whole (`Whole.fallback`); after the prefill's first token went out, the rest is
        resumed elsewhere (`Whole.resume`)."""
        reason = self._whole.choose(req, model)
        cause = None
        if reason is None:
            try:
                return await self._pd(req, model, send)
            except RouterError as exc:
                if req.started and req.track is not None and isinstance(exc, PDError):
                    return await self._whole.resume(req, exc, list(req.tried))
                reason, cause = self._whole.fallback(req, exc), exc
                if reason is None:
                    return await self._fail(req, send, exc)
                self._dispatch.abort(req, "served_whole")
        out = send
        if self._resumable and req.facts.stream:
            out = req.track = self._track(req, send)
        try:
            return await self._whole.serve(req, model, out, reason, cause)
        except RouterError as exc:
            return await self._fail(req, send, exc)

    def _track(self, req: ProxiedRequest, send: Send) -> StreamTrack:
        """The client's send behind a resumable stream (`resume.StreamTrack`)."""
        budget = req.body.get("max_tokens", req.body.get("max_completion_tokens"))
        n = req.body.get("n")
        n = n if type(n) is int and n > 1 else 1
        return StreamTrack(send, chat=req.endpoint == CHAT, asked_ids=req.asked_ids, budget=budget, n=n)

    async def _fail(self, req: ProxiedRequest, send: Send, exc: RouterError) -> str:
        if not req.started:
            await self._reply_error(send, req, exc)
        else:  # the prefill's first token went out: the stream ends with the error instead
            self._m.error(exc.code.value)
            log.warning("%s after the first token: %s", exc.code.value, detail(exc))
            await end_stream(send, exc, req.end)
        return exc.code.value

    async def _pd(self, req: ProxiedRequest, model: str, send: Send) -> str:
        """Prefill, then decode, of one prompt; the decode's answer gets what the prefill's answer adds."""
        if self._mooncake is not None:
            if self._resumable and req.facts.stream:  # strips the ids the client did not ask for; resumes
                send = req.track = self._track(req, send)
            return await self._mooncake.pd(req, model, send)
        traced = self._tracing is not None  # without tracing, no phase context managers on the hot path
        if traced:
            with self._phase(req, "prefill"):
                await self._dispatch.prefill(req, model)
        else:
            await self._dispatch.prefill(req, model)
        chat = req.endpoint == CHAT
        facts = prefill_facts(req.prefill_answer, chat, req.prefill_kv)
        if decode_recomputes(req.body, chat):
            facts = PrefillFacts(None, facts.prompt_logprobs)
        ft = None
        if req.first_token:
            if req.ledger_prefill:  # a pdgate prefill: vLLM's stock connectors load the whole prompt
                ft = read(req.prefill_answer, max_tokens=req.body["max_tokens"], max_model_len=req.limit)
            self._first_tokens[ft is not None].inc()
            if ft is not None:
                send = await self._send_first_token(send, req, ft)
                facts = PrefillFacts(facts.transferred, facts.prompt_logprobs, first_token=True)
        send = PatchingSend(
            send, facts, chat, drop_prompt_ids=facts.first_token and req.asked_ids, stream=ft is not None
        )
        if self._resumable and req.facts.stream:  # the engine's events are tracked before they are patched
            track = req.track = self._track(req, send)
            send = track
            if ft is not None:  # the decode's prompt ends with the first token, its budget one token less
                track.prompt_ids = [*ft.prompt_token_ids, ft.token_id]
                track.head = {"id": ft.answer_id, "created": ft.created, "model": ft.model}
                track.budget = None if track.budget is None else track.budget - 1
                track.given = 1
        if not traced:
            return await self._dispatch.decode(req, send)
        with self._phase(req, "decode"):
            return await self._dispatch.decode(req, send)

    async def _send_first_token(self, send: Send, req: ProxiedRequest, ft: FirstToken) -> Send:
        """Stream the prefill's first token now; the decode continues after it (`first_token`). Returns
        the client's send for the decode's relay, which must not start the response a second time."""
        req.spliced = SplicedBody(decode_body(req.body, ft))
        headers = [(b"content-type", _SSE), (b"x-request-id", req.rid)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        req.started = True
        await send({"type": "http.response.body", "body": first_event(ft, token_ids=req.asked_ids), "more_body": True})
        return _Started(send)

    @contextlib.contextmanager
    def _phase(self, req: ProxiedRequest, name: str) -> Iterator[None]:
        """A child span of the request's, whose trace context the engine requests carry (with tracing only)."""
        assert self._tracing is not None
        kept = [(k, v) for k, v in req.extra if k not in TRACE_HEADERS]
        with self._tracing.phase(name) as (span, headers):
            req.extra = kept + headers
            yield
            if req.prefill is not None and name == "prefill":
                span.set_attribute("pdgate.instance", req.prefill.id)

    def _resolve_model(self, model: str | None) -> str:
        pool = self._pool
        if model is not None:
            if model in pool.prefills or model in pool.decodes:
                return model
            if not pool.instances or any(o.model == model for o in pool.left_out):
                raise _unpooled(pool, model)
            raise ModelNotFound(f"The model `{model}` does not exist.")
        known = pool.known_models()
        if len(known) == 1:
            return known[0]
        if not known:
            raise _unpooled(pool, None)
        raise BadRequest(f"'model' is required: this router serves {', '.join(known)}")

    async def drain_background(self, timeout: float = 5.0) -> None:
        """Wait for the handoff aborts still in flight (at shutdown)."""
        await self._dispatch.drain_background(timeout)


_SSE = b"text/event-stream; charset=utf-8"  # what vLLM's stream says


def _unpooled(pool: Pool, model: str | None) -> NoCompatiblePair:
    """No instance of `model` in the pool: the client reads how many records were left out and why,
    the log also which ones (`left_out.unpooled`)."""
    left_out = pool.left_out
    return NoCompatiblePair(unpooled(left_out, model, full=False), detail=unpooled(left_out, model, full=True))


class _Started:
    """The client's send once the response has started: a decode's status line is not sent again."""

    __slots__ = ("_send",)

    def __init__(self, send: Send) -> None:
        self._send = send

    async def __call__(self, msg: Message) -> None:
        if msg["type"] != "http.response.start":
            await self._send(msg)


def _on_disconnect(req: ProxiedRequest, task: asyncio.Task[Any] | None) -> None:
    """A client that goes away before the response ended cancels the request (`protocol.Watch`)."""
    if not req.finished and task is not None:
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

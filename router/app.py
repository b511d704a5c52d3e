"""The router's app factory: `create_app(settings)` -> an ASGI app.

Two layers. The two proxy routes (`POST /v1/completions`, `POST /v1/chat/completions`) are raw ASGI
(`proxy.Proxy`): measured, FastAPI's request handling costs ~70 us more per request than a raw ASGI
callable under uvicorn, which is a fifth of the router's budget. vLLM's other routes (`/tokenize`,
`/v1/embeddings`, ...) go whole to one instance of the model (`passthrough.Passthrough`, raw ASGI too).
Everything else is a FastAPI app: `GET /v1/models` (the instances' own cards: `model_cards`), `/health`,
`/metrics`, the status page and, with no `--metaserver`, the embedded metaserver's routes on this port.

Who may do what (`access`): client API keys open the OpenAI routes; the admin token opens the embedded
metaserver's routes and the instance URLs in `/health`; with no admin token the router is in protected
mode (those rights belong to loopback peers only, said at start-up). Proxied requests that come back
from a router get 508 (`loops`); a registration of the router's own address gets 422. Unknown routes,
trailing slashes and wrong methods get JSON errors in the OpenAI shape (RFC 7807 under the
metaserver's prefixes), a 405 with `Allow`.

The FastAPI lifespan owns every resource: the upstream HTTP pool, the metaserver (an in-process
`MetaService` + sweeper and its `LocalMetaClient`, or a `MetaClient`), the first registry snapshot and
the background refresh and health tasks. Tests may inject `meta` (any `MetaAPI`), `upstream` (any
`Upstream`, e.g. `HttpxUpstream` over `httpx.MockTransport`), `rng` and `clock`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from random import Random
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from pdgate.metaserver.settings import MetaSettings
from pdgate.router import status as status_page
from pdgate.router.access import AdminCheck, ClientKeys
from pdgate.router.bodies import CHAT, COMPLETIONS
from pdgate.router.breaker import BreakerConfig
from pdgate.router.discovery import Discovery
from pdgate.router.errors import MethodNotAllowed, RouterError, Unauthorized, error_body
from pdgate.router.health import health_body
from pdgate.router.loops import is_own_address
from pdgate.router.metrics import RouterMetrics
from pdgate.router.model_cards import ModelCards
from pdgate.router.passthrough import GET_ROUTES, POST_ROUTES, Passthrough
from pdgate.router.policies import make_policy
from pdgate.router.pool import LiveInstance, Pool
from pdgate.router.proxy import Proxy
from pdgate.router.routes import PROXY_PATHS, RAW_ROUTES, render_openai, serving_protocol
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import send_error
from pdgate.router.tracing import Tracing, make_tracing
from pdgate.router.validation import ChatCompletionRequest, CompletionRequest, ErrorResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdgate import claim_seal
from pdgate.asgi import Message, Receive, Scope, Send
from pdgate.errors import Code
from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaAPI
from pdgate.meta_pooled import PooledMetaClient
from pdgate.route_methods import allowed_methods
from pdgate.upstream import Upstream

__all__ = ["PROXY_PATHS", "RouterApp", "create_app", "embedded_meta_settings", "render_openai", "serving_protocol"]

log = logging.getLogger("pdgate.router")

_META_PREFIXES = ("/v1/instances", "/v1/handoffs")
_REGISTER = "/v1/instances"


def embedded_meta_settings(s: RouterSettings) -> MetaSettings:
    """The embedded metaserver's settings: its own `PDGATE_METASERVER_*` (or older `PDGATE_*`) environment,
    overridden only by what the router's settings actually set."""
    overrides: dict[str, Any] = {"store": s.store}
    if s.admin_token is not None:
        overrides.update(admin_token=s.admin_token, admin_token_file=None)
    if s.allowed_engine_networks:
        overrides["allowed_engine_networks"] = s.allowed_engine_networks
    return MetaSettings(**overrides)


class RouterApp:
    """ASGI entry: proxy routes straight to `Proxy`, the rest to the FastAPI app."""

    def __init__(
        self,
        api: FastAPI,
        proxy: Proxy,
        passthrough: Passthrough,
        pool: Pool,
        discovery: Discovery,
        metrics: RouterMetrics,
        holder: dict[str, Any],
        rest: Callable[..., Any] | None = None,
        *,
        embedded: bool = False,
        max_register_bytes: int = 1 << 20,
    ) -> None:
        self.api = api
        self._rest: Callable[..., Any] = rest or api  # the FastAPI app, behind the metaserver's fast path when embedded
        self.proxy = proxy
        self.passthrough = passthrough
        self.pool = pool
        self.discovery = discovery
        self.metrics = metrics
        self._holder = holder
        self._embedded = embedded
        self._max_register = max_register_bytes
        self._timed = holder["status"].timing.wrap if "status" in holder else None  # TTFT/TPOT (client_timing)

    @property
    def meta(self) -> MetaAPI:
        """The metaserver the router uses (in-process when embedded); valid while the app runs."""
        meta: MetaAPI = self._holder["meta"]
        return meta

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = RAW_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if raw is not None:
            if scope["method"] != raw.method:
                err = MethodNotAllowed(f"{scope['method']} is not allowed on {scope['path']}; use {raw.method}")
                await send_error(send, err, [(b"allow", raw.method.encode())], lambda: None)
            elif raw.handler == "proxy":
                await self.proxy(scope, receive, self._timed(send) if self._timed is not None else send)
            else:
                await self.passthrough(scope, receive, send)
            return
        if self._embedded and scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == _REGISTER:
            replay = await self._refuse_own_address(scope, receive, send)
            if replay is None:
                return
            receive = replay
        await self._rest(scope, receive, send)

    async def _refuse_own_address(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read a registration; answer 422 when its URL is the socket it arrived on (the router itself),
        else hand back a `receive` that replays the body to the metaserver's route."""
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return None
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            more = msg.get("more_body", False)
            if size > self._max_register:
                break  # the route refuses it with 413; no need to look
        body = b"".join(parts)
        if not more:
            try:
                url = orjson.loads(body).get("url")
            except (orjson.JSONDecodeError, AttributeError):
                url = None
            server = scope.get("server")
            if isinstance(url, str) and is_own_address(url, tuple(server) if server else None):
                from pdgate.metaserver.errors import InvalidInput, problem_response

                err = InvalidInput(
                    f"body.url: {url} is this router's own address; registering it would make the router "
                    "forward requests to itself"
                )
                answer: Any = problem_response(err, instance=scope["path"])
                await answer(scope, receive, send)
                return None
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        return replay


def create_app(
    settings: RouterSettings | None = None,
    *,
    meta_settings: MetaSettings | None = None,
    meta: MetaAPI | None = None,
    upstream: Upstream | None = None,
    registry: CollectorRegistry | None = None,
    rng: Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
) -> RouterApp:
    """The router. `tracing` replaces what --otlp-traces-endpoint would build (tests: an in-memory exporter)."""
    s = settings or RouterSettings()
    tracing = tracing or make_tracing(s.otlp_traces_endpoint)
    parts = _Parts(s, registry, clock)
    embedded = meta is None and s.embedded
    msettings = meta_settings or (embedded_meta_settings(s) if embedded else None)
    # The token of the ledger's write routes: the admin check's, and what the router's claims are sealed
    # with (pdgate.claim_seal; the decodes' connectors hold the same token).
    ledger_token = msettings.admin_token if msettings is not None else s.admin_token or s.metaserver_token
    parts.pool.key_public_names(claim_seal.claim_key(ledger_token))  # client-facing names, alike on every worker
    holder = parts.holder
    proxy = _proxy(s, parts, rng or Random(), clock, tracing, ledger_token)
    admin = AdminCheck(ledger_token)
    passthrough = Passthrough(
        s, parts.pool, lambda: holder["upstream"], clock, admin, trace_dropped=parts.metrics.trace_dropped.inc
    )
    parts.metrics.inflight.set_function(lambda: proxy.inflight)
    discovery = Discovery(s, parts.pool, lambda: holder["meta"], lambda: holder["upstream"], parts.metrics, clock)
    embedded_settings = msettings if embedded else None
    lifespan = _lifespan(s, parts, proxy, discovery, admin, tracing, meta, upstream, embedded_settings)
    api = FastAPI(
        title="pdgate router",
        description="OpenAI-compatible front door for prefill/decode disaggregated vLLM.",
        lifespan=lifespan,
        redirect_slashes=False,  # a trailing slash is a JSON 404, not an empty 307
    )
    _error_handlers(api, embedded=embedded)
    _openai_routes(api, parts, ClientKeys(s.api_key))
    _ops_routes(api, parts, discovery, admin)
    holder["status"] = status_page.for_router(s, parts.metrics.registry, parts.pool, discovery, clock, holder)
    status_page.install(api, holder["status"], admin)  # GET / and /status: the page; /status/data: its numbers
    rest: Any = api
    if embedded:
        from pdgate.metaserver.api import build_router
        from pdgate.metaserver.fastpath import FastPath

        assert msettings is not None
        api.include_router(build_router(lambda: holder["svc"], msettings))
        if msettings.fast_path:  # the engines' ledger calls skip FastAPI's per-request machinery
            inner: Any = api
            rest = FastPath(inner, get_service=lambda: holder["svc"], settings=msettings)
    return RouterApp(
        api,
        proxy,
        passthrough,
        parts.pool,
        discovery,
        parts.metrics,
        holder,
        rest,
        embedded=embedded,
        max_register_bytes=msettings.max_body_bytes if msettings is not None else 1 << 20,
    )


def _proxy(
    s: RouterSettings,
    parts: _Parts,
    rng: Random,
    clock: Callable[[], float],
    tracing: Tracing | None,
    token: str | None,
) -> Proxy:
    """The request path, with its policies (fed by the KV-event index when --kv-events is on)."""
    holder = parts.holder
    kv = holder["kv_events"] = _kv_events(s, parts.metrics)  # None unless --kv-events / --kv-events-port
    options = {
        "load_factor": s.prefix_load_factor,
        "kv_index": kv.index if kv is not None else None,
        "hash_seed": s.kv_events_hash_seed,
    }
    return Proxy(
        s,
        pool=parts.pool,
        meta=lambda: holder["meta"],
        upstream=lambda: holder["upstream"],
        metrics=parts.metrics,
        prefill_policy=make_policy(s.prefill_policy, **options),
        decode_policy=make_policy(s.decode_policy, **options),
        engine_metaserver=s.engine_metaserver_url() if s.port else s.advertise_metaserver or s.metaserver,
        rng=rng,
        clock=clock,
        cards=parts.cards,
        tracing=tracing,
        claim_key=claim_seal.claim_key(token),
    )


class _Parts:
    """What the app's routes and lifespan share: the pool, the metrics, the model cards and the holder
    of what lives only while the app runs (`upstream`, `meta`, and `svc` when embedded)."""

    def __init__(self, s: RouterSettings, registry: CollectorRegistry | None, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.metrics = metrics = RouterMetrics(registry)
        self.holder: dict[str, Any] = {}
        inflight_children: dict[str, Any] = {}

        def on_inflight(tr: LiveInstance) -> None:
            child = inflight_children.get(tr.id)
            if child is None:
                child = inflight_children[tr.id] = metrics.instance_inflight.labels(tr.id, tr.view.role.value)
            child.set(tr.requests)

        self.pool = Pool(
            BreakerConfig(failures=s.breaker_failures, open_s=s.breaker_open_s, successes=s.breaker_successes),
            on_breaker=metrics.set_breaker,
            on_inflight=on_inflight,
        )
        auth = [(b"authorization", f"Bearer {s.upstream_api_key}".encode())] if s.upstream_api_key else []
        self.cards = ModelCards(self.pool, lambda: self.holder["upstream"], clock, s.health_timeout_s, lambda: auth)


def _kv_events(s: RouterSettings, metrics: RouterMetrics) -> Any:
    """The KV-event following (router/kv_events.py) when configured; imported only then (pyzmq, msgspec)."""
    if not s.kv_events and s.kv_events_port is None:
        return None
    from pdgate.router.kv_events import KVEvents

    kv = KVEvents.from_settings(s, on_outcome=metrics.kv_event_batch)
    metrics.follow_index(kv.index)
    return kv


def _lifespan(
    s: RouterSettings,
    parts: _Parts,
    proxy: Proxy,
    discovery: Discovery,
    admin: AdminCheck,
    tracing: Tracing | None,
    meta: MetaAPI | None,
    upstream: Upstream | None,
    embedded: MetaSettings | None,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The FastAPI lifespan: it owns every resource (upstream pool, metaserver or its client, tracing, the
    first registry snapshot, the background loops) and closes them in reverse order. `embedded`: the
    settings of the in-process metaserver, None when there is none (`meta` injected, or --metaserver)."""
    holder = parts.holder

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if upstream is None:
                pool_ = HttpPool(connect_timeout=s.connect_timeout_s)
                stack.push_async_callback(pool_.aclose)
                holder["upstream"] = pool_
            else:
                holder["upstream"] = upstream
            if tracing is not None:
                stack.callback(tracing.shutdown)
            if meta is not None:
                holder["meta"] = meta
            elif embedded is not None:
                await _start_embedded(stack, holder, embedded, admin, parts.metrics)
            else:
                holder["meta"] = await _meta_client(stack, s)
            stack.push_async_callback(proxy.drain_background)
            await discovery.refresh_once()
            await discovery.health_once()
            discovery.start()
            stack.push_async_callback(discovery.stop)
            holder["status"].start()  # the status page's readings (router/status.py)
            stack.push_async_callback(holder["status"].stop)
            if holder.get("kv_events") is not None:
                holder["kv_events"].start(lambda: parts.pool.views, s.refresh_interval_s)
                stack.push_async_callback(holder["kv_events"].stop)
            yield

    return lifespan


async def _start_embedded(
    stack: contextlib.AsyncExitStack,
    holder: dict[str, Any],
    msettings: MetaSettings,
    admin: AdminCheck,
    metrics: RouterMetrics,
) -> None:
    """The in-process metaserver (service + sweeper) and its LocalMetaClient, closed with the stack."""
    if admin.token is None:
        log.warning(
            "protected mode: no admin token is set, so the embedded metaserver's /v1/instances and "
            "/v1/handoffs routes and the instance URLs in /health answer loopback peers only; set "
            "PDGATE_ROUTER_ADMIN_TOKEN (or PDGATE_METASERVER_ADMIN_TOKEN, or --admin-token-file) for "
            "engines on other hosts"
        )
    from pdgate.metaserver.app import running_service
    from pdgate.metaserver.local import LocalMetaClient

    svc = await stack.enter_async_context(running_service(msettings, registry=metrics.registry))
    holder["svc"] = svc
    holder["meta"] = LocalMetaClient(svc)


async def _meta_client(stack: contextlib.AsyncExitStack, s: RouterSettings) -> MetaAPI:
    """The client of --metaserver (pooled connections, ledger batches), closed with the stack."""
    assert s.metaserver is not None
    meta_pool = HttpPool(connect_timeout=s.connect_timeout_s)
    stack.push_async_callback(meta_pool.aclose)
    client = PooledMetaClient(
        s.metaserver,
        pool=meta_pool,
        admin_token=s.metaserver_token,
        timeout=s.metaserver_timeout_s,
        max_connections=s.metaserver_connections,
        batches=s.metaserver_batches,
    )
    stack.push_async_callback(client.aclose)
    return client


def _error_handlers(api: FastAPI, *, embedded: bool) -> None:
    """Typed router errors as they are; FastAPI's 404/405/422 in the OpenAI shape (RFC 7807 under the
    embedded metaserver's prefixes), a 405 naming every method the path serves."""

    @api.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> Response:
        return Response(exc.body(), status_code=exc.status, headers={k.decode(): v.decode() for k, v in exc.headers()})

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(api.router.routes, dict(request.scope)) or headers.get("Allow", "")
        path = request.url.path
        if embedded and path.startswith(_META_PREFIXES):
            from pdgate.metaserver.api import error_from_exception
            from pdgate.metaserver.errors import problem_response

            return problem_response(error_from_exception(exc), instance=path, headers=headers)
        code = {404: Code.NOT_FOUND, 405: Code.METHOD_NOT_ALLOWED}.get(exc.status_code, Code.INVALID_REQUEST)
        message = {
            404: f"no route {path}; the OpenAI routes are POST /v1/completions, POST /v1/chat/completions "
            "and GET /v1/models, and vLLM's " + ", ".join(sorted(POST_ROUTES | GET_ROUTES)) + " are passed through",
            405: f"{request.method} is not allowed on {path}; allowed: {headers.get('Allow', '')}",
        }.get(exc.status_code, str(exc.detail))
        body = error_body(message, "invalid_request_error", code.value)
        headers["x-pdgate-error"] = code.value
        return Response(body, status_code=exc.status_code, headers=headers, media_type="application/json")


_OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the engine's answer: JSON, or server-sent events with stream=true",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **{status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 502, 503, 504, 508)},
}


def _openai_routes(api: FastAPI, parts: _Parts, keys: ClientKeys) -> None:
    """The OpenAI routes: the two proxy routes (declared for the OpenAPI document only: RouterApp serves
    them, see `routes.RAW_ROUTES`) and GET /v1/models."""

    @api.post(
        COMPLETIONS, tags=["openai"], responses=_OPENAI_ERRORS, summary="Create a completion (prefill, then decode)"
    )
    async def completions_doc(body: CompletionRequest) -> Response:  # pragma: no cover - never routed here
        raise StarletteHTTPException(404)

    @api.post(
        CHAT, tags=["openai"], responses=_OPENAI_ERRORS, summary="Create a chat completion (prefill, then decode)"
    )
    async def chat_doc(body: ChatCompletionRequest) -> Response:  # pragma: no cover - never routed here
        raise StarletteHTTPException(404)

    @api.get("/v1/models", tags=["openai"])
    async def models(request: Request) -> Response:
        """The models with a prefill/decode pair now, each with its instances' own card (vLLM's fields,
        `max_model_len` included); a minimal card when no instance told its own."""
        if not keys.allows(request.headers.get("authorization")):
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
        data = []
        for m in parts.pool.models(parts.clock()):
            card = await parts.cards.card(m)
            data.append(
                dict(card)
                if card
                else {"id": m, "object": "model", "created": 0, "owned_by": "pdgate", "root": m, "parent": None}
            )
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


def _ops_routes(api: FastAPI, parts: _Parts, discovery: Discovery, admin: AdminCheck) -> None:
    """GET /health (instance URLs for the admin only) and GET /metrics."""

    @api.get("/health", tags=["ops"], responses={503: {"description": "no compatible pair, or no registry"}})
    async def health(request: Request) -> Response:
        peer = request.client.host if request.client is not None else None
        full = admin.holds(request.headers.get("authorization"), peer)
        status, body = health_body(parts.pool, discovery, parts.clock(), full=full)
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    @api.get("/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        svc = parts.holder.get("svc")
        if svc is not None:  # embedded metaserver: its store-wide gauges are read at scrape time
            await svc.metrics.refresh_from_store(svc.store)
        return Response(parts.metrics.render(), media_type=CONTENT_TYPE_LATEST)

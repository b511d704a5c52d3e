"""The router's app factory: `create_app(settings)` -> an ASGI app.

Two layers. The two proxy routes (`POST /v1/completions`, `POST /v1/chat/completions`) are raw ASGI
(`proxy.Proxy`): measured, FastAPI's request handling costs ~70 us more per request than a raw ASGI
callable under uvicorn, which is a fifth of the router's budget. Everything else is a FastAPI app:
`GET /v1/models`, `GET /health`, `GET /metrics` and, with no `--metaserver`, the embedded metaserver's
`/v1/instances` and `/v1/handoffs` routes on the same port.

The FastAPI lifespan owns every resource: the upstream HTTP pool, the metaserver (an in-process
`MetaService` + sweeper and its `LocalMetaClient`, or a `MetaClient`), the first registry snapshot and
the background refresh and health tasks. Tests may inject `meta` (any `MetaAPI`), `upstream` (any
`Upstream`, e.g. `HttpxUpstream` over `httpx.MockTransport`), `rng` and `clock`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from random import Random
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from pdgate.metaserver.client import MetaAPI
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.bodies import CHAT, COMPLETIONS
from pdgate.router.breaker import BreakerConfig
from pdgate.router.discovery import Discovery
from pdgate.router.errors import MethodNotAllowed, RouterError, Unauthorized
from pdgate.router.meta import PooledMetaClient
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import make_policy
from pdgate.router.pool import Pool, Tracker
from pdgate.router.proxy import Proxy
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import send_error
from pdgate.router.upstream import HttpPool, Upstream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

__all__ = ["PROXY_PATHS", "RouterApp", "create_app"]

PROXY_PATHS = frozenset({COMPLETIONS, CHAT})


class RouterApp:
    """ASGI entry: proxy routes straight to `Proxy`, the rest to the FastAPI app."""

    def __init__(
        self,
        api: FastAPI,
        proxy: Proxy,
        pool: Pool,
        discovery: Discovery,
        metrics: RouterMetrics,
        holder: dict,
        rest: Callable[..., Any] | None = None,
    ) -> None:
        self.api = api
        self._rest = rest or api  # the FastAPI app, behind the metaserver's fast path when embedded
        self.proxy = proxy
        self.pool = pool
        self.discovery = discovery
        self.metrics = metrics
        self._holder = holder

    @property
    def meta(self) -> MetaAPI:
        """The metaserver the router uses (in-process when embedded); valid while the app runs."""
        meta: MetaAPI = self._holder["meta"]
        return meta

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] in PROXY_PATHS:
            if scope["method"] == "POST":
                await self.proxy(scope, receive, send)
                return
            err = MethodNotAllowed(f"{scope['method']} is not allowed on {scope['path']}; use POST")
            await send_error(send, err, [(b"allow", b"POST")], lambda: None)
            return
        await self._rest(scope, receive, send)


def create_app(
    settings: RouterSettings | None = None,
    *,
    meta_settings: MetaSettings | None = None,
    meta: MetaAPI | None = None,
    upstream: Upstream | None = None,
    registry: CollectorRegistry | None = None,
    rng: Random | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RouterApp:
    s = settings or RouterSettings()
    metrics = RouterMetrics(registry)
    holder: dict[str, Any] = {}
    inflight_children: dict[str, Any] = {}

    def on_inflight(tr: Tracker) -> None:
        child = inflight_children.get(tr.id)
        if child is None:
            child = inflight_children[tr.id] = metrics.instance_inflight.labels(tr.id, tr.view.role.value)
        child.set(tr.requests)

    pool = Pool(
        BreakerConfig(failures=s.breaker_failures, open_s=s.breaker_open_s, successes=s.breaker_successes),
        on_breaker=metrics.set_breaker,
        on_inflight=on_inflight,
    )
    options = {"load_factor": s.prefix_load_factor}
    proxy = Proxy(
        s,
        pool=pool,
        meta=lambda: holder["meta"],
        upstream=lambda: holder["upstream"],
        metrics=metrics,
        prefill_policy=make_policy(s.prefill_policy, **options),
        decode_policy=make_policy(s.decode_policy, **options),
        engine_metaserver=s.engine_metaserver_url() if s.port else s.advertise_metaserver or s.metaserver,
        rng=rng or Random(),
        clock=clock,
    )
    metrics.inflight.set_function(lambda: proxy.inflight)
    discovery = Discovery(s, pool, lambda: holder["meta"], lambda: holder["upstream"], metrics, clock)
    embedded = meta is None and s.embedded
    msettings = meta_settings or (MetaSettings(store=s.store, admin_token=s.admin_token) if embedded else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if upstream is None:
                pool_ = HttpPool(connect_timeout=s.connect_timeout_s)
                stack.push_async_callback(pool_.aclose)
                holder["upstream"] = pool_
            else:
                holder["upstream"] = upstream
            if meta is not None:
                holder["meta"] = meta
            elif embedded:
                from pdgate.metaserver.app import running_service
                from pdgate.metaserver.local import LocalMetaClient

                assert msettings is not None
                svc = await stack.enter_async_context(running_service(msettings, registry=metrics.registry))
                holder["svc"] = svc
                holder["meta"] = LocalMetaClient(svc)
            else:
                assert s.metaserver is not None
                meta_pool = HttpPool(connect_timeout=s.connect_timeout_s)
                stack.push_async_callback(meta_pool.aclose)
                client = PooledMetaClient(
                    s.metaserver, pool=meta_pool, token=s.metaserver_token, timeout=s.metaserver_timeout_s
                )
                stack.push_async_callback(client.aclose)
                holder["meta"] = client
            stack.push_async_callback(proxy.drain_background)
            await discovery.refresh_once()
            await discovery.health_once()
            discovery.start()
            stack.push_async_callback(discovery.stop)
            yield

    api = FastAPI(
        title="pdgate router",
        description="OpenAI-compatible front door for prefill/decode disaggregated vLLM.",
        lifespan=lifespan,
    )
    keys = [k.encode() for k in s.api_key]

    def check_key(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        if header[:7].lower() == "bearer " and header[7:].strip().encode() in keys:
            return
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")

    @api.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> Response:
        return Response(exc.body(), status_code=exc.status, headers={k.decode(): v.decode() for k, v in exc.headers()})

    @api.get("/v1/models", tags=["openai"])
    async def models(request: Request) -> Response:
        check_key(request)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "pdgate", "root": m, "parent": None}
            for m in pool.models(clock())
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    @api.get("/health", tags=["ops"])
    async def health() -> Response:
        now = clock()
        served = pool.models(now)
        reason = None
        if not served:
            known = pool.known_models()
            reason = (
                "; ".join(pool.explain(m, now) for m in known)
                if known
                else "no prefill or decode instance is registered"
            )
        instances = [
            {
                "id": tr.id,
                "role": tr.view.role.value,
                "url": tr.view.url,
                "model": tr.view.model,
                "dp_rank": tr.view.dp_rank,
                "available": (why := tr.unavailable(now)) is None,
                "reason": why,
                "inflight": tr.requests,
                "breaker": tr.breaker.state(now).value,
            }
            for tr in pool.trackers.values()
        ]
        body = {
            "status": "ok" if served else "unavailable",
            "reason": reason,
            "models": served,
            "registry_error": discovery.registry_error,
            "instances": instances,
        }
        return Response(orjson.dumps(body), status_code=200 if served else 503, media_type="application/json")

    @api.get("/metrics", tags=["ops"])
    async def prometheus() -> Response:
        svc = holder.get("svc")
        if svc is not None:  # embedded metaserver: its store-wide gauges are read at scrape time
            await svc.metrics.refresh_from_store(svc.store)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    rest: Any = api
    if embedded:
        from pdgate.metaserver.api import build_router
        from pdgate.metaserver.fastpath import FastPath

        assert msettings is not None
        api.include_router(build_router(lambda: holder["svc"], msettings))
        if msettings.fast_path:  # the engines' ledger calls skip FastAPI's per-request machinery
            rest = FastPath(api, get_service=lambda: holder["svc"], settings=msettings)

    return RouterApp(api, proxy, pool, discovery, metrics, holder, rest)

"""The metaserver app factory and the service lifecycle.

`create_app(settings)` builds the FastAPI app: its lifespan opens the store and starts the sweeper
(`running_service`), the routes come from `api.build_router`, plus `GET /health` (503 when the store is
unreachable), `GET /metrics` (Prometheus) and OpenAPI at `/docs`. With `settings.fast_path` the hot
ledger routes are answered by `fastpath.FastPath` before FastAPI (same answers, less CPU).

`running_service(settings)` is usable from another app's lifespan, e.g. the router running the
metaserver in-process:

    async with running_service(settings, registry=router_registry) as service:
        ...   # service: MetaService; wrap it in local.LocalMetaClient, mount api.build_router(...)

It opens the store named by `settings.store`, starts one sweeper, and on exit stops the sweeper and
closes the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pdgate.metaserver.api import build_router, error_from_exception
from pdgate.metaserver.client import MetaError
from pdgate.metaserver.errors import problem_response
from pdgate.metaserver.fastpath import FastPath
from pdgate.metaserver.metrics import MetaMetrics
from pdgate.metaserver.models import CONTRACT_VERSION, Problem
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import LedgerPolicy, open_store
from pdgate.metaserver.sweeper import Sweeper
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["create_app", "policy_from", "running_service"]


def policy_from(settings: MetaSettings) -> LedgerPolicy:
    return LedgerPolicy(
        terminal_ttl_s=settings.terminal_ttl_s,
        events_maxlen=settings.events_maxlen,
        events_ttl_s=settings.events_ttl_s,
        max_claims=settings.max_claims,
    )


@contextlib.asynccontextmanager
async def running_service(
    settings: MetaSettings, *, registry: CollectorRegistry | None = None, sweep: bool = True
) -> AsyncIterator[MetaService]:
    """An open store, a MetaService over it and (unless `sweep=False`) its sweeper, for the block's duration."""
    store = open_store(settings.store, policy=policy_from(settings))
    service = MetaService(store, settings, MetaMetrics(registry))
    sweeper = Sweeper(service, interval_s=settings.sweep_interval_s)
    try:
        if sweep:
            sweeper.start()
        yield service
    finally:
        await sweeper.stop()
        await store.close()


def create_app(settings: MetaSettings | None = None, *, registry: CollectorRegistry | None = None) -> FastAPI:
    settings = settings or MetaSettings()
    holder: dict[str, MetaService] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running_service(settings, registry=registry) as service:
            holder["service"] = service
            app.state.service = service
            yield

    def service() -> MetaService:
        return holder["service"]

    app = FastAPI(
        title="pdgate metaserver",
        version=str(CONTRACT_VERSION),
        description="Instance registry and KV handoff ledger for prefill/decode disaggregated serving.",
        lifespan=lifespan,
    )
    app.include_router(build_router(service, settings))

    @app.get("/health", tags=["ops"], responses={503: {"model": Problem}})
    async def health(request: Request) -> Response:
        try:
            info = await service().health()
        except MetaError as exc:
            return problem_response(exc, instance=request.url.path)
        return Response(orjson.dumps(info), media_type="application/json")

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def metrics() -> Response:
        svc = service()
        await svc.metrics.refresh_from_store(svc.store)
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def problem(request: Request, exc: Exception) -> Response:
        return problem_response(error_from_exception(exc), instance=request.url.path)

    app.add_exception_handler(StarletteHTTPException, problem)
    app.add_exception_handler(RequestValidationError, problem)
    if settings.fast_path:
        app.add_middleware(FastPath, get_service=service, settings=settings)
    return app

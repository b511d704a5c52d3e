"""The metaserver app factory and the service lifecycle.

`create_app(settings)` builds the FastAPI app: its lifespan opens the store and starts the sweeper
(`running_service`), the routes come from `api.build_router`, plus `GET /health` (503 with the reason
when the store is unreachable or slower than `health_timeout_s`), `GET /metrics` (Prometheus) and
OpenAPI at `/docs`; those four stay open to anyone, the /v1 routes need the admin token (or, in
protected mode, a loopback peer: see `guards.py`). A path with a trailing slash is a 404 like any
unknown path (no redirect), and every error is RFC 7807. `server_limits(settings)` and
`render_problem` give `pdgate.serving` what it needs to bound slow and greedy clients. With `settings.fast_path` the hot
ledger routes are answered by `fastpath.FastPath` before FastAPI (same answers, less CPU).

`running_service(settings)` is usable from another app's lifespan, e.g. the router running the
metaserver in-process:

    async with running_service(settings, registry=router_registry) as service:
        ...   # service: MetaService; wrap it in local.LocalMetaClient, mount api.build_router(...)

It opens the store named by `settings.store`, starts one sweeper, and on exit stops the sweeper and
closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pdgate.metaserver.api import build_router, error_from_exception, error_headers
from pdgate.metaserver.errors import PROBLEM_MEDIA_TYPE, StoreUnavailable, problem_response
from pdgate.metaserver.fastpath import FastPath
from pdgate.metaserver.metrics import MetaMetrics
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import LedgerPolicy, open_store
from pdgate.metaserver.sweeper import Sweeper
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdgate.errors import CODES, Code
from pdgate.meta_client import MetaError
from pdgate.models import CONTRACT_VERSION, Problem
from pdgate.route_methods import allowed_methods
from pdgate.serving import ServerLimits

__all__ = ["access_summary", "create_app", "policy_from", "render_problem", "running_service", "server_limits"]

log = logging.getLogger("pdgate.metaserver")


def access_summary(settings: MetaSettings) -> str:
    """One start-up log line saying who may use the /v1 routes (protected mode is said loudly)."""
    if settings.protected_mode:
        return (
            "protected mode: no admin token, so /v1 routes answer loopback peers only "
            "(set PDGATE_ADMIN_TOKEN or --admin-token-file to serve other hosts)"
        )
    reads = "writes and reads" if settings.auth_reads else "writes (reads are open: --no-auth-reads)"
    return f"admin token required on /v1 {reads}"


def server_limits(settings: MetaSettings) -> ServerLimits:
    return ServerLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_body_bytes=settings.max_body_bytes,
        max_connections=settings.max_connections,
    )


def render_problem(code: Code, detail: str) -> tuple[bytes, bytes]:
    """A refusal of `pdgate.serving` (408, 413, 503) as an RFC 7807 body, like every other error here."""
    status = CODES[code].status
    problem = {"type": "about:blank", "title": HTTPStatus(status).phrase, "status": status, "detail": detail}
    return PROBLEM_MEDIA_TYPE.encode(), orjson.dumps({**problem, "code": code.value})


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
            log.info("%s", access_summary(settings))
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
        redirect_slashes=False,
    )
    app.include_router(build_router(service, settings))

    @app.get("/health", tags=["ops"], responses={503: {"model": Problem}})
    async def health(request: Request) -> Response:
        try:
            info = await asyncio.wait_for(service().health(), settings.health_timeout_s)
        except TimeoutError:
            err = StoreUnavailable(f"the store did not answer a ping within {settings.health_timeout_s:g} s")
            return problem_response(err, instance=request.url.path)
        except MetaError as exc:
            return problem_response(exc, instance=request.url.path)
        return Response(orjson.dumps(info), media_type="application/json")

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def metrics() -> Response:
        svc = service()
        await svc.metrics.refresh_from_store(svc.store)
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def problem(request: Request, exc: Exception) -> Response:
        err = error_from_exception(exc)
        headers = error_headers(err, exc)
        if err.status == 405:
            headers = {"Allow": allowed_methods(app.router.routes, dict(request.scope))}
        return problem_response(err, instance=request.url.path, headers=headers)

    app.add_exception_handler(StarletteHTTPException, problem)
    app.add_exception_handler(RequestValidationError, problem)
    if settings.fast_path:
        app.add_middleware(FastPath, get_service=service, settings=settings)
    return app

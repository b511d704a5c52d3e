"""The metaserver's HTTP routes: thin adapters from HTTP to `MetaService`.

`build_router(service, settings)` returns an `APIRouter` with every `/v1/instances` and `/v1/handoffs`
route. It is self-contained (its route class renders errors as RFC 7807 problems, checks who may call
(`guards.AccessGuard`: admin token, or loopback peers in protected mode), bounds body sizes and long-polls
and records latency), so another FastAPI app can mount it as it is. The router's
embedded mode does:

    holder: dict[str, MetaService] = {}
    app.include_router(build_router(lambda: holder["svc"], settings))
    # in the app's lifespan:
    async with running_service(settings) as svc:      # metaserver.app
        holder["svc"] = svc
        yield

`service` may be the service itself or a zero-argument callable returning it (the service exists only
once a lifespan has opened its store).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pdgate.metaserver.errors import (
    AdminTokenRequired,
    BodyTooLarge,
    InvalidInput,
    MalformedBody,
    RouteNotFound,
    StoreFailure,
    problem_response,
)
from pdgate.metaserver.guards import AccessGuard, LongPolls, TooManyLongPolls
from pdgate.metaserver.routes import ROUTES, Call, InstanceList, Reply, Route, parse_body
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdgate.meta_client import MetaError
from pdgate.models import Problem

__all__ = [
    "InstanceList",
    "build_router",
    "error_from_exception",
    "error_headers",
    "from_request_validation",
    "parse_body",
    "read_body",
]

log = logging.getLogger(__name__)

_JSON = "application/json"
ENGINE = "pdgate.engine"  # scope key: the caller's engine token's instance (guards.AccessGuard.check)


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": Problem, "content": {"application/problem+json": {}}} for s in statuses}


def from_request_validation(exc: RequestValidationError) -> MetaError:
    """FastAPI's validation error as one of ours: 400 for unparsable JSON, else 422 naming each field."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        ctx: dict[str, Any] = next((e.get("ctx", {}) for e in errors if e.get("type") == "json_invalid"), {})
        return MalformedBody(f"body is not valid JSON: {ctx.get('error', 'parse error')}")
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return InvalidInput("; ".join(parts) or "invalid request")


def error_from_exception(exc: Exception) -> MetaError:
    if isinstance(exc, MetaError):
        return exc
    if isinstance(exc, RequestValidationError):
        return from_request_validation(exc)
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return RouteNotFound(f"no route {exc.detail}" if exc.detail != "Not Found" else "no such route")
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            return MetaError(f"method not allowed here; allowed: {allow}", status=405, code="method_not_allowed")
        return MetaError(str(exc.detail), status=exc.status_code, code="http_error")
    log.exception("unexpected error", exc_info=exc)
    return StoreFailure(f"internal error: {type(exc).__name__}", code="internal_error")


def error_headers(err: MetaError, exc: BaseException | None = None) -> dict[str, str] | None:
    """Headers an error answer carries: WWW-Authenticate on 401, Retry-After on 429, Allow on 405."""
    if isinstance(err, AdminTokenRequired):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(err, TooManyLongPolls):
        return {"Retry-After": "1"}
    if err.status == 405 and isinstance(exc, StarletteHTTPException) and exc.headers:
        return {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 past `limit` bytes, declared (Content-Length) or streamed (chunked)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidInput(f"header.content-length: {declared!r} is not a number") from None
        if size > limit:
            raise BodyTooLarge(f"body of {size} bytes is over the limit of {limit} bytes")
        return await request.body()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _body_doc(model: type[BaseModel], *, required: bool = True, inline: str | None = None) -> dict[str, Any]:
    """OpenAPI requestBody for a body parsed by `parse_body`; nested models refer to components that the
    response models already register (Role, TransportAddress, InstanceLoad, ...). Nested models whose
    name starts with `inline` (no response registers them: a batch's items) are written in place."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    if inline:
        schema = _inlined(schema, {f"#/components/schemas/{k}": v for k, v in defs.items() if k.startswith(inline)})
    return {"requestBody": {"required": required, "content": {_JSON: {"schema": schema}}}}


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in defs:
            return _inlined(defs[ref], defs)
        out = {k: _inlined(v, defs) for k, v in node.items()}
        mapping = out.get("discriminator", {}).get("mapping")
        if isinstance(mapping, dict) and any(target in defs for target in mapping.values()):
            out["discriminator"] = {k: v for k, v in out["discriminator"].items() if k != "mapping"}
        return out
    if isinstance(node, list):
        return [_inlined(v, defs) for v in node]
    return node


def _render(reply: Reply) -> Response:
    model, status = reply
    if model is None:
        return Response(status_code=status)
    body = model if isinstance(model, bytes) else model.__pydantic_serializer__.to_json(model)
    return Response(body, status_code=status, media_type=_JSON)


MakeCall = Callable[[Route, Request, dict[str, Any]], Awaitable[Call]]


def _endpoint(route: Route, make_call: MakeCall) -> Callable[..., Any]:
    """A FastAPI endpoint for one row of `ROUTES`: its signature declares the row's path and query
    parameters (so FastAPI parses and documents them), and its body is the row's `run`."""

    async def endpoint(request: Request, **values: Any) -> Response:
        return _render(await route.run(await make_call(route, request, values)))

    path = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=str) for n in route.params]
    request = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    endpoint.__signature__ = inspect.Signature([request, *path, *route.query])  # type: ignore[attr-defined]
    endpoint.__name__ = route.name
    return endpoint


def _problem_route(guard: AccessGuard, get_service: Callable[[], MetaService]) -> type[APIRoute]:
    """The route class of `build_router`: errors -> RFC 7807, access, latency, around each route."""
    specs = {route.name: route for route in ROUTES}

    class ProblemRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()
            route = self.path
            spec = specs[self.name]
            observers: dict[tuple[int, str, int], Any] = {}  # label children, looked up once each

            async def handler(request: Request) -> Response:
                start = time.perf_counter()
                try:
                    peer = request.client.host if request.client is not None else None
                    auth = request.headers.get("authorization")
                    request.scope[ENGINE] = guard.check(auth, peer, write=spec.write, admin=spec.admin)
                    response = await inner(request)
                except Exception as exc:
                    err = error_from_exception(exc)
                    response = problem_response(err, instance=request.url.path, headers=error_headers(err, exc))
                metric = get_service().metrics.request_latency
                key = (id(metric), request.method, response.status_code)
                child = observers.get(key)
                if child is None:
                    child = observers[key] = metric.labels(request.method, route, str(response.status_code))
                child.observe(time.perf_counter() - start)
                return response

            return handler

    return ProblemRoute


def build_router(service: MetaService | Callable[[], MetaService], settings: MetaSettings) -> APIRouter:
    """Every row of `routes.ROUTES` as a FastAPI route (see the module docstring)."""
    get_service: Callable[[], MetaService] = service if not isinstance(service, MetaService) else (lambda: service)
    long_polls = LongPolls(settings.max_long_polls)

    async def make_call(spec: Route, request: Request, values: dict[str, Any]) -> Call:
        params = {name: values.pop(name) for name in spec.params}
        raw = await read_body(request, settings.max_body_bytes) if spec.write else b""
        engine = request.scope.get(ENGINE)
        return Call(get_service(), settings, long_polls, params, raw, values, engine)

    router = APIRouter(route_class=_problem_route(AccessGuard(settings), get_service))
    common = _problems(400, 401, 403, 413, 422, 503)
    for spec in ROUTES:
        extra = _body_doc(spec.body, required=spec.body_required, inline=spec.inline) if spec.body else None
        router.add_api_route(
            spec.path,
            _endpoint(spec, make_call),
            methods=[spec.method],
            status_code=spec.status,
            response_model=spec.response_model,
            responses={**common, **_problems(*spec.errors)},
            tags=[spec.tag],
            summary=spec.summary,
            name=spec.name,
            openapi_extra=extra,
        )
    return router

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

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pdgate.metaserver.batch import parse_batch, render_batch, run_batch
from pdgate.metaserver.errors import (
    AdminTokenRequired,
    BodyTooLarge,
    InvalidInput,
    MalformedBody,
    RouteNotFound,
    StoreFailure,
    StoreUnavailable,
    from_validation_error,
    problem_response,
)
from pdgate.metaserver.guards import AccessGuard, LongPolls, TooManyLongPolls, check_cursor
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdgate.meta_client import MetaError
from pdgate.models import (
    AbortBody,
    BatchBody,
    BatchResults,
    ClaimBody,
    DoneBody,
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HeartbeatBody,
    HeartbeatResponse,
    Instance,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    Problem,
    RegisterResponse,
    Role,
)
from pdgate.urls import InvalidEngineURL, check_engine_url

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
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# How much longer than its ?wait= a long-poll may take before it answers 503 (a hung store).
POLL_MARGIN_S = 2.0

_WRITES = frozenset({"POST", "PUT", "DELETE", "PATCH"})
_JSON = "application/json"


class InstanceList(BaseModel):
    """Body of `GET /v1/instances` (documentation only; built directly as JSON)."""

    instances: list[Instance]


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": Problem, "content": {"application/problem+json": {}}} for s in statuses}


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type=_JSON)


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


def parse_body(raw: bytes, model: type[M], *, optional: bool = False) -> M | None:
    """Validate a JSON body straight from bytes (pydantic's parser: one pass, no dict in between).

    Why not FastAPI's body parameters: this path is the ledger's hot path (four calls per handoff), and
    parsing here is several times cheaper; the OpenAPI document still shows each body (`_body_doc`).
    """
    if not raw.strip():
        if optional:
            return None
        raise InvalidInput("body: Field required (a JSON object)")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        bad_json = [e for e in exc.errors(include_url=False) if e.get("type") == "json_invalid"]
        if bad_json:
            raise MalformedBody(f"body is not valid JSON: {bad_json[0].get('msg', 'parse error')}") from None
        raise from_validation_error(exc, "body") from None


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


def build_router(service: MetaService | Callable[[], MetaService], settings: MetaSettings) -> APIRouter:
    get_service: Callable[[], MetaService] = service if not isinstance(service, MetaService) else (lambda: service)
    guard = AccessGuard(settings)
    long_polls = LongPolls(settings.max_long_polls)
    max_body = settings.max_body_bytes
    networks = settings.engine_networks

    class ProblemRoute(APIRoute):
        """Errors -> RFC 7807, admin token, body bound and latency, around each route of this router."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()
            route = self.path
            writes = bool(self.methods & _WRITES)
            observers: dict[tuple[int, str, int], Any] = {}  # label children, looked up once each

            async def handler(request: Request) -> Response:
                start = time.perf_counter()
                try:
                    peer = request.client.host if request.client is not None else None
                    guard.check(request.headers.get("authorization"), peer, write=writes)
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

    async def bounded(op: Awaitable[T], wait: float) -> T:
        """A long-poll answers within its wait plus a margin, even while the store hangs (a frozen Redis)."""
        limit = min(wait, settings.max_wait_s) + POLL_MARGIN_S
        try:
            return await asyncio.wait_for(op, limit)
        except TimeoutError:
            raise StoreUnavailable(f"the store did not answer within {limit:g} s; retry") from None

    router = APIRouter(route_class=ProblemRoute)
    common = _problems(400, 401, 403, 413, 422, 503)
    polls = _problems(429)

    # -- registry ----------------------------------------------------------------------------
    @router.post(
        "/v1/instances",
        response_model=RegisterResponse,
        openapi_extra=_body_doc(InstanceRegistration),
        responses=common,
        tags=["registry"],
        summary="Register an instance, or update its record",
    )
    async def register(request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), InstanceRegistration)
        assert body is not None
        if networks:
            try:
                check_engine_url(body.url, networks)
            except InvalidEngineURL as exc:
                raise InvalidInput(f"body.url: {exc}") from None
        return _json(await get_service().register(body))

    @router.post(
        "/v1/instances/{instance_id}/heartbeat",
        openapi_extra=_body_doc(HeartbeatBody, required=False),
        response_model=HeartbeatResponse,
        responses={**common, **_problems(404)},
        tags=["registry"],
        summary="Renew the lease (404 once it lapsed: register again)",
    )
    async def heartbeat(instance_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), HeartbeatBody, optional=True)
        load = body.load if body is not None else None
        return _json(await get_service().heartbeat(instance_id, load))

    @router.post(
        "/v1/instances/{instance_id}/drain",
        response_model=Instance,
        responses={**common, **_problems(404)},
        tags=["registry"],
        summary="Stop giving the instance new work",
    )
    async def drain(instance_id: str) -> Response:
        return _json(await get_service().drain(instance_id))

    @router.delete(
        "/v1/instances/{instance_id}",
        status_code=204,
        responses={**common, **_problems(404)},
        tags=["registry"],
        summary="Remove an instance",
    )
    async def deregister(instance_id: str) -> Response:
        await get_service().deregister(instance_id)
        return Response(status_code=204)

    @router.get(
        "/v1/instances",
        response_model=InstanceList,
        responses=common,
        tags=["registry"],
        summary="Live instances; role=prefill|decode also lists role=both",
    )
    async def list_instances(
        role: Role | None = None, model: str | None = None, state: InstanceState | None = None
    ) -> Response:
        found = await get_service().list_instances(role=role, model=model, state=state)
        body = orjson.dumps({"instances": [i.model_dump(mode="json") for i in found]})
        return Response(body, media_type=_JSON)

    @router.get(
        "/v1/instances/{instance_id}",
        response_model=Instance,
        responses={**common, **_problems(404)},
        tags=["registry"],
        summary="One live instance",
    )
    async def get_instance(instance_id: str) -> Response:
        return _json(await get_service().get_instance(instance_id))

    @router.get(
        "/v1/instances/{instance_id}/handoff-events",
        response_model=HandoffEvents,
        responses={**common, **polls},
        tags=["handoffs"],
        summary="Terminal transitions of this prefill's handoffs, in order, after `cursor`",
    )
    async def handoff_events(
        instance_id: str,
        cursor: str | None = Query(
            None, description="the `cursor` of the last answer (`<n>` or `<n>-<m>`); absent: the oldest event kept"
        ),
        wait: float | None = Query(None, ge=0, description="long-poll up to this many seconds (capped)"),
    ) -> Response:
        check_cursor(cursor)
        if not wait:
            return _json(await get_service().events(instance_id, cursor, wait))
        with long_polls.hold():
            return _json(await bounded(get_service().events(instance_id, cursor, wait), wait))

    # -- handoff ledger ----------------------------------------------------------------------
    ledger_errors = {**common, **_problems(404, 409, 410)}

    @router.post(
        "/v1/handoffs",
        status_code=201,
        openapi_extra=_body_doc(HandoffCreate),
        response_model=Handoff,
        responses={**common, **_problems(409)},
        tags=["handoffs"],
        summary="Create a PENDING handoff (transfer_id minted when absent)",
    )
    async def create_handoff(request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), HandoffCreate)
        assert body is not None
        return _json(await get_service().create_handoff(body), 201)

    @router.put(
        "/v1/handoffs/{transfer_id}/ready",
        openapi_extra=_body_doc(KVLocation),
        response_model=Handoff,
        responses=ledger_errors,
        tags=["handoffs"],
        summary="PENDING -> READY: record where the KV lives",
    )
    async def mark_ready(transfer_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), KVLocation)
        assert body is not None
        return _json(await get_service().mark_ready(transfer_id, body))

    @router.post(
        "/v1/handoffs/{transfer_id}/claim",
        openapi_extra=_body_doc(ClaimBody),
        response_model=Handoff,
        responses=ledger_errors,
        tags=["handoffs"],
        summary="READY -> CLAIMED: exactly one decode wins; others get 409",
    )
    async def claim(transfer_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), ClaimBody)
        assert body is not None
        return _json(await get_service().claim(transfer_id, body.decode_instance_id, body.lease_s))

    @router.post(
        "/v1/handoffs/{transfer_id}/done",
        openapi_extra=_body_doc(DoneBody, required=False),
        response_model=Handoff,
        responses=ledger_errors,
        tags=["handoffs"],
        summary="CLAIMED -> DONE: the decode pulled the KV",
    )
    async def done(transfer_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), DoneBody, optional=True)
        decode = body.decode_instance_id if body is not None else None
        return _json(await get_service().done(transfer_id, decode))

    @router.post(
        "/v1/handoffs/{transfer_id}/abort",
        openapi_extra=_body_doc(AbortBody, required=False),
        response_model=Handoff,
        responses=ledger_errors,
        tags=["handoffs"],
        summary="Any live state -> ABORTED",
    )
    async def abort(transfer_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request, max_body), AbortBody, optional=True)
        reason = body.reason if body is not None else AbortBody().reason
        return _json(await get_service().abort(transfer_id, reason))

    @router.post(
        "/v1/handoffs/batch",
        openapi_extra=_body_doc(BatchBody, inline="Batch"),
        response_model=BatchResults,
        responses=common,
        tags=["handoffs"],
        summary="Many create/ready/claim/done/abort calls in one request, each answered on its own",
    )
    async def batch(request: Request) -> Response:
        items = parse_batch(await read_body(request, max_body))
        outcomes = await run_batch(get_service(), items)
        return Response(render_batch(items, outcomes), media_type=_JSON)

    @router.get(
        "/v1/handoffs/{transfer_id}",
        response_model=Handoff,
        responses={**common, **_problems(404), **polls},
        tags=["handoffs"],
        summary="One handoff; ?wait=S long-polls until it leaves PENDING",
    )
    async def get_handoff(
        transfer_id: str,
        wait: float | None = Query(None, ge=0, description="long-poll up to this many seconds (capped)"),
    ) -> Response:
        if not wait:
            return _json(await get_service().get_handoff(transfer_id, wait))
        with long_polls.hold():
            return _json(await bounded(get_service().get_handoff(transfer_id, wait), wait))

    return router

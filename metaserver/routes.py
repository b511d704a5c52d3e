"""The metaserver's one table of routes (`ROUTES`): what each /v1 route is, and the one function that serves it.

Why one table: the routes are served two ways, by FastAPI (`api.build_router`: the documented, mountable
surface, long-polls, everything) and by the lean ASGI fast path in front of it (`fastpath.FastPath`: the
ledger's hot routes, measured several times cheaper). Both are built from these rows, so a route cannot
exist in one and not the other, nor answer differently: a row's `run` is the only code between the
parsed request (`Call`) and `MetaService`. A row marked `fast` is served by the fast path when its
request has no query string (a long-poll's `?wait=` goes to FastAPI); `match` is an exact match on the
path's segments, as FastAPI's own (`POST /v1/handoffsXYZ` is no route).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import orjson
from fastapi import Query
from pdgate.metaserver.batch import BATCH_ROUTE, parse_batch, render_batch, run_batch
from pdgate.metaserver.errors import InvalidInput, MalformedBody, StoreUnavailable, from_validation_error
from pdgate.metaserver.guards import Forbidden, LongPolls, check_cursor
from pdgate.metaserver.service import MetaService, check_id
from pdgate.metaserver.settings import MetaSettings
from pydantic import BaseModel, ValidationError

from pdgate.auth import engine_token
from pdgate.models import (
    AbortBody,
    BatchBody,
    BatchResults,
    ClaimBody,
    DoneBody,
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HandoffState,
    HeartbeatBody,
    HeartbeatResponse,
    Instance,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    RegisterResponse,
    Role,
)
from pdgate.urls import InvalidEngineURL, check_engine_url

__all__ = ["ROUTES", "Call", "EngineToken", "HandoffList", "InstanceList", "Reply", "Route", "parse_body"]

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# How much longer than its ?wait= a long-poll may take before it answers 503 (a hung store).
POLL_MARGIN_S = 2.0
WRITES = frozenset({"POST", "PUT", "DELETE", "PATCH"})


class InstanceList(BaseModel):
    """Body of `GET /v1/instances` (documentation only; built directly as JSON)."""

    instances: list[Instance]


class HandoffList(BaseModel):
    """Body of `GET /v1/handoffs` (documentation only; built directly as JSON)."""

    handoffs: list[Handoff]


class EngineToken(BaseModel):
    """Answer of `POST /v1/instances/{instance_id}/token`: the engine token of that instance."""

    instance_id: str
    token: str


def parse_body(raw: bytes, model: type[M], *, optional: bool = False) -> M | None:
    """Validate a JSON body straight from bytes, in pydantic's strict JSON mode (one pass, no dict).

    Why not FastAPI's body parameters: this is the ledger's hot path (four calls per handoff), and
    parsing here is several times cheaper. Strict: "10" or true is not a number, [[true]] not a block id.
    """
    if not raw.strip():
        if optional:
            return None
        raise InvalidInput("body: Field required (a JSON object)")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        bad_json = [e for e in exc.errors(include_url=False) if e.get("type") == "json_invalid"]
        if bad_json:
            raise MalformedBody(f"body is not valid JSON: {bad_json[0].get('msg', 'parse error')}") from None
        raise from_validation_error(exc, "body") from None


@dataclass(frozen=True)
class Call:
    """One request as a route's `run` sees it, whichever way it came in."""

    svc: MetaService
    settings: MetaSettings
    long_polls: LongPolls
    params: Mapping[str, str]  # path parameters
    body: bytes = b""
    query: Mapping[str, Any] = field(default_factory=dict)  # FastAPI's parsed query (the fast path has none)
    engine: str | None = None  # the caller's engine token's instance; None: full access


# A record, an already rendered JSON body, or None (204), with the status.
Reply = tuple[BaseModel | bytes | None, int]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    run: Callable[[Call], Awaitable[Reply]]
    summary: str
    tag: str
    response_model: type[BaseModel] | None
    status: int = 200
    body: type[BaseModel] | None = None  # documented request body (parsed by `run`)
    body_required: bool = True
    inline: str | None = None  # nested models documented in place (see api._body_doc)
    errors: tuple[int, ...] = ()  # problem statuses beyond the common ones
    query: tuple[inspect.Parameter, ...] = ()  # FastAPI query parameters (documented, parsed)
    fast: bool = False  # also served by the fast path (query-less requests)
    admin: bool = False  # the admin token's alone

    @property
    def name(self) -> str:
        return self.run.__name__

    @property
    def write(self) -> bool:
        return self.method in WRITES

    @cached_property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.split("/"))

    @cached_property
    def params(self) -> tuple[str, ...]:
        return tuple(s[1:-1] for s in self.segments if s.startswith("{"))

    def match(self, method: str, parts: list[str]) -> dict[str, str] | None:
        """The path parameters when `method` and the path's segments (`path.split("/")`) are this route
        exactly: each literal segment equal, each parameter one non-empty segment."""
        if method != self.method:
            return None
        mine = self.segments
        if len(parts) != len(mine):
            return None
        found: dict[str, str] = {}
        for part, seg in zip(parts, mine, strict=True):
            if seg.startswith("{"):
                if not part:
                    return None
                found[seg[1:-1]] = part
            elif part != seg:
                return None
        return found


async def bounded(c: Call, op: Callable[[], Awaitable[T]], wait: float) -> T:
    """A long-poll answers within its wait plus a margin, even while the store hangs (a frozen Redis);
    past `max_long_polls` at once it is refused (429) before `op` starts."""
    limit = min(wait, c.settings.max_wait_s) + POLL_MARGIN_S
    try:
        with c.long_polls.hold():
            return await asyncio.wait_for(op(), limit)
    except TimeoutError:
        raise StoreUnavailable(f"the store did not answer within {limit:g} s; retry") from None


def _body(c: Call, model: type[M]) -> M:
    body = parse_body(c.body, model)
    assert body is not None
    return body


# -- registry --------------------------------------------------------------------------------------------
async def register(c: Call) -> Reply:
    body = _body(c, InstanceRegistration)
    if c.settings.engine_networks:
        try:
            check_engine_url(body.url, c.settings.engine_networks)
        except InvalidEngineURL as exc:
            raise InvalidInput(f"body.url: {exc}") from None
    return await c.svc.register(body, engine=c.engine), 200


async def heartbeat(c: Call) -> Reply:
    body = parse_body(c.body, HeartbeatBody, optional=True)
    load = body.load if body is not None else None
    return await c.svc.heartbeat(c.params["instance_id"], load, engine=c.engine), 200


async def drain(c: Call) -> Reply:
    return await c.svc.drain(c.params["instance_id"], engine=c.engine), 200


async def undrain(c: Call) -> Reply:
    return await c.svc.undrain(c.params["instance_id"], engine=c.engine), 200


async def deregister(c: Call) -> Reply:
    await c.svc.deregister(c.params["instance_id"], engine=c.engine)
    return None, 204


async def list_instances(c: Call) -> Reply:
    q = c.query
    found = await c.svc.list_instances(role=q.get("role"), model=q.get("model"), state=q.get("state"))
    return orjson.dumps({"instances": [i.model_dump(mode="json") for i in found]}), 200


async def list_handoffs(c: Call) -> Reply:
    found = await c.svc.list_handoffs(state=c.query.get("state"), limit=c.query.get("limit", 100))
    return orjson.dumps({"handoffs": [h.model_dump(mode="json") for h in found]}), 200


async def get_instance(c: Call) -> Reply:
    return await c.svc.get_instance(c.params["instance_id"]), 200


async def handoff_events(c: Call) -> Reply:
    instance_id, cursor, wait = c.params["instance_id"], c.query.get("cursor"), c.query.get("wait")
    check_cursor(cursor)
    if not wait:
        return await c.svc.events(instance_id, cursor, wait), 200
    return await bounded(c, lambda: c.svc.events(instance_id, cursor, wait), wait), 200


async def instance_token(c: Call) -> Reply:
    instance_id = check_id(c.params["instance_id"], "instance_id")
    secret = c.settings.admin_token
    if secret is None:
        raise Forbidden("no admin token is configured: engine tokens are derived from it")
    return EngineToken(instance_id=instance_id, token=engine_token(secret, instance_id)), 200


# -- handoff ledger --------------------------------------------------------------------------------------
async def create_handoff(c: Call) -> Reply:
    return await c.svc.create_handoff(_body(c, HandoffCreate), engine=c.engine), 201


async def mark_ready(c: Call) -> Reply:
    return await c.svc.mark_ready(c.params["transfer_id"], _body(c, KVLocation), engine=c.engine), 200


async def claim(c: Call) -> Reply:
    body = _body(c, ClaimBody)
    return await c.svc.claim(c.params["transfer_id"], body.decode_instance_id, body.lease_s, engine=c.engine), 200


async def done(c: Call) -> Reply:
    body = _body(c, DoneBody)
    return await c.svc.done(c.params["transfer_id"], body.decode_instance_id, engine=c.engine), 200


async def abort(c: Call) -> Reply:
    body = parse_body(c.body, AbortBody, optional=True)
    reason = body.reason if body is not None else AbortBody().reason
    return await c.svc.abort(c.params["transfer_id"], reason, engine=c.engine), 200


async def batch(c: Call) -> Reply:
    items = parse_batch(c.body)
    return render_batch(items, await run_batch(c.svc, items, engine=c.engine)), 200


async def get_handoff(c: Call) -> Reply:
    transfer_id, wait = c.params["transfer_id"], c.query.get("wait")
    if not wait:
        return await c.svc.get_handoff(transfer_id, wait), 200
    return await bounded(c, lambda: c.svc.get_handoff(transfer_id, wait), wait), 200


def _query(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


_WAIT = _query("wait", float | None, Query(None, ge=0, description="long-poll up to this many seconds (capped)"))
_CURSOR = Query(None, description="the `cursor` of the last answer (`<n>` or `<n>-<m>`); absent: the oldest event kept")
_LEDGER = (404, 409, 410)

# In matching order (a literal segment before a parameter, as FastAPI tries them).
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/instances", register, "Register an instance, or update its record", "registry",
          RegisterResponse, body=InstanceRegistration),
    Route("POST", "/v1/instances/{instance_id}/heartbeat", heartbeat,
          "Renew the lease (404 once it lapsed: register again)", "registry", HeartbeatResponse,
          body=HeartbeatBody, body_required=False, errors=(404,)),
    Route("POST", "/v1/instances/{instance_id}/drain", drain, "Stop giving the instance new work", "registry",
          Instance, errors=(404,)),
    Route("POST", "/v1/instances/{instance_id}/undrain", undrain, "Undo a drain: the instance takes new work again",
          "registry", Instance, errors=(404,)),
    Route("POST", "/v1/instances/{instance_id}/token", instance_token,
          "The engine token of this instance id (admin token only; see SECURITY.md)", "registry", EngineToken,
          admin=True),
    Route("DELETE", "/v1/instances/{instance_id}", deregister, "Remove an instance", "registry", None, status=204,
          errors=(404,)),
    Route("GET", "/v1/instances", list_instances, "Live instances; role=prefill|decode also lists role=both",
          "registry", InstanceList,
          query=(_query("role", Role | None, None), _query("model", str | None, None),
                 _query("state", InstanceState | None, None))),
    Route("GET", "/v1/instances/{instance_id}", get_instance, "One live instance", "registry", Instance,
          errors=(404,)),
    Route("GET", "/v1/instances/{instance_id}/handoff-events", handoff_events,
          "Terminal transitions of this prefill's handoffs, in order, after `cursor`", "handoffs", HandoffEvents,
          errors=(429,), query=(_query("cursor", str | None, _CURSOR), _WAIT)),
    Route("GET", "/v1/handoffs", list_handoffs,
          "Live handoffs (admin token only), the nearest lease end first; ?state=READY, ?limit=N", "handoffs",
          HandoffList, admin=True,
          query=(_query("state", HandoffState | None, None), _query("limit", int, Query(100, ge=1, le=1000)))),
    Route("POST", "/v1/handoffs", create_handoff, "Create a PENDING handoff (transfer_id minted when absent)",
          "handoffs", Handoff, status=201, body=HandoffCreate, errors=(409,), fast=True),
    Route("PUT", "/v1/handoffs/{transfer_id}/ready", mark_ready, "PENDING -> READY: record where the KV lives",
          "handoffs", Handoff, body=KVLocation, errors=_LEDGER, fast=True),
    Route("POST", "/v1/handoffs/{transfer_id}/claim", claim,
          "READY -> CLAIMED: exactly one decode wins; others get 409", "handoffs", Handoff, body=ClaimBody,
          errors=_LEDGER, fast=True),
    Route("POST", "/v1/handoffs/{transfer_id}/done", done, "CLAIMED -> DONE: the decode pulled the KV", "handoffs",
          Handoff, body=DoneBody, errors=_LEDGER, fast=True),
    Route("POST", "/v1/handoffs/{transfer_id}/abort", abort, "Any live state -> ABORTED", "handoffs", Handoff,
          body=AbortBody, body_required=False, errors=_LEDGER, fast=True),
    Route("POST", BATCH_ROUTE, batch,
          "Many create/ready/claim/done/abort calls in one request, each answered on its own", "handoffs",
          BatchResults, body=BatchBody, inline="Batch", fast=True),
    Route("GET", "/v1/handoffs/{transfer_id}", get_handoff, "One handoff; ?wait=S long-polls until it leaves PENDING",
          "handoffs", Handoff, errors=(404, 429), query=(_WAIT,), fast=True),
)  # fmt: skip

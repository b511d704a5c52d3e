"""`POST /v1/handoffs/batch`: many ledger calls in one request, each answered on its own.

Why: the engines' control threads and the router make many ledger calls at once (every READY, claim,
DONE or abort waiting when a call goes out). As single requests, each costs the metaserver a full HTTP
request's CPU and each caller a round trip; in one batch, the HTTP cost is paid once and the items reach
the store together (on Redis, `store/pipeline.Pipeliner` sends the script calls of items in flight at
once as one pipeline), so neither side falls behind under load.

Semantics, shared by the FastAPI route (`api.py`) and the fast path (`fastpath.py`):
  * the envelope (`{"items": [...]}`, 1 to `MAX_BATCH_ITEMS` items, bounded body) is checked first: a bad
    envelope fails the whole request (400 not JSON, 413 too many items, 422 wrong shape);
  * each item is validated on its own: a bad item is answered with its own 422 problem and never fails
    its neighbours;
  * items about one transfer id run in batch order (a claim then a DONE of one handoff is meaningful),
    items about different ids run concurrently;
  * each item's outcome is what its single route would answer: `status` with the record, or the RFC 7807
    problem (`instance` is the single route's path).
Each item moves the ledger through `MetaService` exactly as its single route does (same checks, metrics
and logs); a batch adds no rule of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

import orjson
from pdgate.metaserver.errors import (
    BodyTooLarge,
    InternalError,
    InvalidInput,
    MalformedBody,
    from_validation_error,
    problem_body,
)
from pdgate.metaserver.service import MetaService
from pydantic import TypeAdapter, ValidationError

from pdgate.meta_client import MetaError
from pdgate.models import (
    MAX_BATCH_ITEMS,
    BatchAbort,
    BatchBody,
    BatchClaim,
    BatchCreate,
    BatchDone,
    BatchItem,
    BatchReady,
    Handoff,
)

__all__ = ["BATCH_ROUTE", "Outcome", "item_path", "parse_batch", "render_batch", "run_batch"]

log = logging.getLogger(__name__)

BATCH_ROUTE = "/v1/handoffs/batch"
_ITEM: TypeAdapter[BatchItem] = TypeAdapter(BatchItem)

Outcome = Handoff | MetaError


def parse_batch(raw: bytes) -> list[BatchItem | MetaError]:
    """The items of a batch body, each a valid item or the 422 that refuses it.

    The whole body parses in one pydantic pass when every item is valid (the common case); only when
    something is refused is the envelope checked by hand and each item validated alone, so one bad
    item is answered on its own.
    """
    if not raw.strip():
        raise InvalidInput("body: Field required (a JSON object with 'items')")
    try:
        return list(BatchBody.model_validate_json(raw, strict=True).items)
    except ValidationError:
        pass
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"items"}:
        raise InvalidInput("body: a JSON object with exactly one field, 'items' (a list of ledger calls)")
    items = data["items"]
    if not isinstance(items, list) or not items:
        raise InvalidInput("body.items: a non-empty list of ledger calls")
    if len(items) > MAX_BATCH_ITEMS:
        raise BodyTooLarge(f"body.items: {len(items)} items is over the limit of {MAX_BATCH_ITEMS} per batch")
    out: list[BatchItem | MetaError] = []
    for i, item in enumerate(items):
        try:
            out.append(_ITEM.validate_json(orjson.dumps(item), strict=True))  # strict as a JSON body
        except ValidationError as exc:
            out.append(from_validation_error(exc, f"body.items.{i}"))
    return out


def _call(svc: MetaService, item: BatchItem, engine: str | None) -> Awaitable[Handoff]:
    if isinstance(item, BatchClaim):
        return svc.claim(item.transfer_id, item.decode_instance_id, item.lease_s, engine=engine)
    if isinstance(item, BatchDone):
        return svc.done(item.transfer_id, item.decode_instance_id, engine=engine)
    if isinstance(item, BatchReady):
        return svc.mark_ready(item.transfer_id, item.location, engine=engine)
    if isinstance(item, BatchAbort):
        return svc.abort(item.transfer_id, item.reason, engine=engine)
    return svc.create_handoff(item, engine=engine)


async def _one(svc: MetaService, item: BatchItem, engine: str | None) -> Outcome:
    try:
        return await _call(svc, item, engine)
    except MetaError as exc:
        return exc
    except Exception as exc:  # a bug must not fail the neighbours: logged, answered 500 for this item
        log.exception("batch item %s failed", item.op)
        return InternalError(f"internal error: {type(exc).__name__}")


async def _in_order(svc: MetaService, group: list[tuple[int, BatchItem]], out: list[Any], engine: str | None) -> None:
    for index, item in group:
        out[index] = await _one(svc, item, engine)


async def run_batch(
    svc: MetaService, items: Sequence[BatchItem | MetaError], *, engine: str | None = None
) -> list[Outcome]:
    """Each item's outcome, in the items' order (see the module docstring for the ordering rule).

    `engine`: the caller's engine token's instance (None: full access); each item is held to it alone."""
    out: list[Any] = list(items)  # refused items are their own outcome
    groups: dict[object, list[tuple[int, BatchItem]]] = {}
    for index, item in enumerate(items):
        if isinstance(item, MetaError):
            continue
        key: object = item.transfer_id if item.transfer_id is not None else index  # minted ids never collide
        groups.setdefault(key, []).append((index, item))
    if len(groups) == 1:
        await _in_order(svc, next(iter(groups.values())), out, engine)
    elif groups:
        await asyncio.gather(*(_in_order(svc, group, out, engine) for group in groups.values()))
    svc.metrics.observe_batch(items, out)
    return out


def item_path(item: BatchItem | MetaError) -> str:
    """The single route an item stands for (a problem's `instance`)."""
    if isinstance(item, MetaError):
        return BATCH_ROUTE
    if isinstance(item, BatchCreate):
        return "/v1/handoffs"
    return f"/v1/handoffs/{item.transfer_id}/{item.op}"


def render_batch(items: Sequence[BatchItem | MetaError], outcomes: Sequence[Outcome]) -> bytes:
    """`{"results": [...]}` built from each record's own JSON (no dict in between)."""
    parts = []
    for item, outcome in zip(items, outcomes, strict=True):
        if isinstance(outcome, MetaError):
            problem = problem_body(outcome, instance=item_path(item))
            parts.append(b'{"status":%d,"problem":%s}' % (outcome.status, problem))
        else:
            status = 201 if isinstance(item, BatchCreate) else 200
            parts.append(b'{"status":%d,"handoff":%s}' % (status, outcome.__pydantic_serializer__.to_json(outcome)))
    return b'{"results":[' + b",".join(parts) + b"]}"

"""The metaserver's error tree and its RFC 7807 rendering.

Every service error is a subclass of the client's typed errors (`pdgate.metaserver.client`), so the same
exception means the same thing whether it crossed HTTP (MetaClient rebuilds it from the problem body)
or was raised in-process (`LocalMetaClient`). Each class has a stable `code`.

    MetaError
    ├── MetaBadRequest
    │   ├── InvalidInput        422 validation_error   a field or parameter was refused (detail names it)
    │   ├── MalformedBody       400 malformed_json     the body is not JSON
    │   └── BodyTooLarge        413 body_too_large
    ├── MetaUnauthorized
    │   └── Unauthorized        401 unauthorized       missing or wrong admin token
    ├── MetaNotFound
    │   ├── InstanceNotFound    404 instance_not_found (includes instances whose lease lapsed)
    │   ├── HandoffNotFound     404 handoff_not_found
    │   └── RouteNotFound       404 not_found
    ├── MetaConflict
    │   ├── HandoffExists       409 handoff_exists     transfer_id already used
    │   └── IllegalState        409 illegal_transition current_state says where the record is
    ├── MetaGone
    │   └── HandoffTerminal     410 handoff_terminal   the record is DONE/ABORTED/EXPIRED
    ├── MetaUnavailable
    │   └── StoreUnavailable    503 store_unavailable  the store cannot be reached; retry
    └── StoreFailure            500 store_error        the store answered something we did not expect
"""

from __future__ import annotations

from typing import Any

import orjson
from pdgate.metaserver.client import (
    MetaBadRequest,
    MetaConflict,
    MetaError,
    MetaGone,
    MetaNotFound,
    MetaUnauthorized,
    MetaUnavailable,
)
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.models import Problem
from pydantic import ValidationError
from starlette.responses import Response

__all__ = [
    "PROBLEM_MEDIA_TYPE",
    "BodyTooLarge",
    "HandoffExists",
    "HandoffNotFound",
    "HandoffTerminal",
    "IllegalState",
    "InstanceNotFound",
    "InvalidInput",
    "MalformedBody",
    "RouteNotFound",
    "StoreFailure",
    "StoreUnavailable",
    "Unauthorized",
    "from_illegal",
    "from_validation_error",
    "problem_body",
    "problem_response",
    "to_problem",
]

PROBLEM_MEDIA_TYPE = "application/problem+json"


class InvalidInput(MetaBadRequest):
    code, status = "validation_error", 422


class MalformedBody(MetaBadRequest):
    code, status = "malformed_json", 400


class BodyTooLarge(MetaBadRequest):
    code, status = "body_too_large", 413


class Unauthorized(MetaUnauthorized):
    code, status = "unauthorized", 401


class InstanceNotFound(MetaNotFound):
    code = "instance_not_found"


class HandoffNotFound(MetaNotFound):
    code = "handoff_not_found"


class RouteNotFound(MetaNotFound):
    code = "not_found"


class HandoffExists(MetaConflict):
    code = "handoff_exists"


class IllegalState(MetaConflict):
    code = "illegal_transition"


class HandoffTerminal(MetaGone):
    code = "handoff_terminal"


class StoreUnavailable(MetaUnavailable):
    code = "store_unavailable"


class StoreFailure(MetaError):
    code, status = "store_error", 500


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    410: "Gone",
    413: "Content Too Large",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def from_illegal(exc: IllegalTransition, transfer_id: str) -> MetaError:
    """409 while the record is live (someone else moved it), 410 once it is terminal."""
    detail = f"handoff {transfer_id}: {exc.detail} (it is {exc.current.value})"
    cls = HandoffTerminal if exc.terminal else IllegalState
    return cls(detail, current_state=exc.current)


def from_validation_error(exc: ValidationError, where: str = "body") -> InvalidInput:
    """One readable sentence per refused field, naming it by its path (`body.block_ids.0.1`)."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in (where, *err.get("loc", ())))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return InvalidInput("; ".join(parts) or f"invalid {where}")


def to_problem(exc: MetaError, *, instance: str | None = None) -> Problem:
    extra: dict[str, Any] = {"instance": instance} if instance else {}
    return Problem(
        title=_TITLES.get(exc.status, "Error"),
        status=exc.status,
        detail=exc.detail,
        code=exc.code,
        current_state=exc.current_state,
        **extra,
    )


def problem_body(exc: MetaError, *, instance: str | None = None) -> bytes:
    return orjson.dumps(to_problem(exc, instance=instance).model_dump(mode="json", exclude_none=True))


def problem_response(exc: MetaError, *, instance: str | None = None, headers: dict[str, str] | None = None) -> Response:
    body = problem_body(exc, instance=instance)
    return Response(body, status_code=exc.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)

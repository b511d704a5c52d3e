"""The metaserver's errors, the one table from the pure cores' refusals to them, and their RFC 7807 form.

Every class is a `pdgate.errors.PDGateError` (through the client's families in
`pdgate.meta_client`) whose `code` comes from `pdgate.errors.Code` and whose HTTP status comes
from `pdgate.errors.CODES`, so the same exception means the same thing whether it crossed HTTP
(MetaClient rebuilds it from the problem body) or was raised in-process (`LocalMetaClient`).

    MetaError
    ├── MetaBadRequest
    │   ├── InvalidInput        422 validation_error   a field or parameter was refused (detail names it)
    │   ├── MalformedBody       400 malformed_json     the body is not JSON
    │   └── BodyTooLarge        413 body_too_large
    ├── MetaUnauthorized
    │   └── AdminTokenRequired  401 unauthorized       missing or wrong admin token
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
    ├── StoreFailure            500 store_error        the store answered something we did not expect
    └── InternalError           500 internal_error     a bug: logged with its traceback where it is caught

The pure cores (`ledger`, `registry`) raise their own `PDGateError`s, which know nothing of HTTP;
`core_errors` turns them into the classes above through `CORE_ERRORS`.
"""

from __future__ import annotations

from http import HTTPStatus
from types import TracebackType
from typing import Any

import orjson
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.registry import RegistrationInvalid
from pydantic import ValidationError
from starlette.responses import Response

from pdgate.errors import Code, PDGateError
from pdgate.meta_client import (
    MetaBadRequest,
    MetaConflict,
    MetaError,
    MetaGone,
    MetaNotFound,
    MetaUnauthorized,
    MetaUnavailable,
)
from pdgate.models import Problem

__all__ = [
    "CORE_ERRORS",
    "PROBLEM_MEDIA_TYPE",
    "AdminTokenRequired",
    "BodyTooLarge",
    "HandoffExists",
    "HandoffNotFound",
    "HandoffTerminal",
    "IllegalState",
    "InstanceNotFound",
    "InternalError",
    "InvalidInput",
    "MalformedBody",
    "RouteNotFound",
    "StoreFailure",
    "StoreUnavailable",
    "core_errors",
    "from_core",
    "from_validation_error",
    "problem_body",
    "problem_response",
    "title",
    "to_problem",
]

PROBLEM_MEDIA_TYPE = "application/problem+json"


class InvalidInput(MetaBadRequest):
    code = Code.VALIDATION_ERROR


class MalformedBody(MetaBadRequest):
    code = Code.MALFORMED_JSON


class BodyTooLarge(MetaBadRequest):
    code = Code.BODY_TOO_LARGE


class AdminTokenRequired(MetaUnauthorized):
    code = Code.UNAUTHORIZED


class InstanceNotFound(MetaNotFound):
    code = Code.INSTANCE_NOT_FOUND


class HandoffNotFound(MetaNotFound):
    code = Code.HANDOFF_NOT_FOUND


class RouteNotFound(MetaNotFound):
    code = Code.NOT_FOUND


class HandoffExists(MetaConflict):
    code = Code.HANDOFF_EXISTS


class IllegalState(MetaConflict):
    code = Code.ILLEGAL_TRANSITION


class HandoffTerminal(MetaGone):
    code = Code.HANDOFF_TERMINAL


class StoreUnavailable(MetaUnavailable):
    code = Code.STORE_UNAVAILABLE


class StoreFailure(MetaError):
    code = Code.STORE_ERROR


class InternalError(MetaError):
    code = Code.INTERNAL


# A pure core's refusal (by its code) -> the error a caller of the service sees.
CORE_ERRORS: dict[Code, type[MetaError]] = {
    Code.ILLEGAL_TRANSITION: IllegalState,  # ledger.IllegalTransition on a live record: 409
    Code.HANDOFF_TERMINAL: HandoffTerminal,  # ledger.IllegalTransition on a terminal record: 410
    Code.VALIDATION_ERROR: InvalidInput,  # registry.RegistrationInvalid: 422
}


def from_core(exc: PDGateError, about: str) -> MetaError:
    """The `CORE_ERRORS` entry for `exc`: a refused move names the handoff (`about`, its transfer id) and
    the state it is in (409 while live, 410 once terminal); refused input names where it was (`about`)."""
    cls = CORE_ERRORS.get(exc.code, InternalError)
    if isinstance(exc, IllegalTransition):
        detail = f"handoff {about}: {exc.detail} (it is {exc.current.value})"
        return cls(detail, current_state=exc.current)
    return cls(f"{about}.{exc}")


class core_errors:  # used like the function it was: `with core_errors(tid):`
    """Re-raise the pure cores' refusals inside the block as `from_core` maps them.

    A class, not `contextlib.contextmanager`: every ledger move runs inside one, and the generator-based
    form cost about 1 us per block (a generator, its wrapper, two `next` calls) against ~0.3 us here.
    """

    __slots__ = ("about",)

    def __init__(self, about: str) -> None:
        self.about = about

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, (IllegalTransition, RegistrationInvalid)):
            raise from_core(exc, self.about) from None


def title(status: int) -> str:
    """The problem's `title`: the status's reason phrase from `http.HTTPStatus`, so every status a code can
    carry (429 included) has its own, with no table here to fall behind `pdgate.errors.CODES`."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


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
        title=title(exc.status),
        status=exc.status,
        detail=exc.detail,
        code=exc.code.value if isinstance(exc.code, Code) else str(exc.code),
        current_state=exc.current_state,
        **extra,
    )


def problem_body(exc: MetaError, *, instance: str | None = None) -> bytes:
    return orjson.dumps(to_problem(exc, instance=instance).model_dump(mode="json", exclude_none=True))


def problem_response(exc: MetaError, *, instance: str | None = None, headers: dict[str, str] | None = None) -> Response:
    body = problem_body(exc, instance=instance)
    return Response(body, status_code=exc.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)

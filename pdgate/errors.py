"""pdgate's one error vocabulary: every failure any component reports has a `Code` from this table.

Why one table: the router, the metaserver, the connector and the transports used to keep five
exception trees that were translated into each other by hand, and the connector matched error
strings. Now each failure is a `PDGateError` carrying a `Code`; the code alone decides the HTTP
status, the OpenAI error `type`, and whether a retry elsewhere can help. Each boundary (HTTP answer
-> client exception, transport exception -> pull outcome, metaserver error -> router error) has one
mapping table, applied with `map_exceptions`, in the manner of httpx's `_transports/default.py`.

    PDGateError                 code -> (status, retryable, OpenAI type) from CODES
    └── one subclass per package where callers catch a family (pdgate.metaserver.client.MetaError,
        pdgate.router.errors.RouterError, pdgate.connector.transport.base.TransportError, ...)

`retryable` means "the same operation may succeed on another instance or a bit later"; the router's
retry loop and the connector's control thread read it, and nothing else decides retries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

__all__ = ["CODES", "Code", "CodeInfo", "PDGateError", "info", "map_exceptions"]


class Code(str, Enum):
    """Stable machine codes. Clients and dashboards key on these strings: never rename one."""

    # -- request refused before any work (client's fault) ---------------------------------------
    INVALID_REQUEST = "invalid_request"
    VALIDATION_ERROR = "validation_error"
    MALFORMED_JSON = "malformed_json"
    MULTIPLE_PROMPTS = "multiple_prompts_unsupported"  # no longer sent (prompts fan out); kept: codes are never reused
    UNSUPPORTED_BY_PD = "pd_unsupported_parameter"  # a field PD disaggregation cannot serve (param names it)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code: longer than the model's max_model_len
    BODY_TOO_LARGE = "body_too_large"
    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_API_KEY = "invalid_api_key"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    MODEL_NOT_FOUND = "model_not_found"
    INSTANCE_NOT_FOUND = "instance_not_found"
    HANDOFF_NOT_FOUND = "handoff_not_found"
    INVALID_CURSOR = "invalid_cursor"
    TOO_MANY_REQUESTS = "too_many_requests"
    REQUEST_TIMEOUT = "request_timeout"  # the client did not send its headers in time
    SERVER_BUSY = "server_busy"  # connection limit reached; retry shortly
    UPSTREAM_REJECTED = "upstream_rejected"  # an engine's own 4xx, relayed verbatim
    LOOP_DETECTED = "pd_loop_detected"
    # -- ledger state ---------------------------------------------------------------------------
    HANDOFF_EXISTS = "handoff_exists"
    ILLEGAL_TRANSITION = "illegal_transition"
    HANDOFF_TERMINAL = "handoff_terminal"
    # -- the disaggregated path failed (pd_*) ---------------------------------------------------
    PREFILL_FAILED = "pd_prefill_failed"
    DECODE_FAILED = "pd_decode_failed"
    KV_EXPIRED = "pd_kv_expired"
    KV_NOT_READY = "pd_kv_not_ready"  # a decode's claim found no READY handoff in time
    KV_LOAD_TIMEOUT = "pd_kv_timeout"  # a decode's KV load outlived its deadline
    NO_COMPATIBLE_PAIR = "pd_no_compatible_pair"
    NO_INSTANCE = "pd_no_instance"  # no instance of the model answered a route the router passes through
    OVERLOADED = "pd_overloaded"
    UPSTREAM_TIMEOUT = "pd_upstream_timeout"
    METASERVER_UNAVAILABLE = "pd_metaserver_unavailable"
    BLOCK_PLAN_INVALID = "pd_block_plan_invalid"
    TP_LAYOUT_UNSUPPORTED = "pd_tp_layout_unsupported"
    INVALID_TRANSFER_PARAMS = "pd_invalid_transfer_params"
    LOCATION_MISMATCH = "pd_location_mismatch"
    # -- the store ------------------------------------------------------------------------------
    STORE_UNAVAILABLE = "store_unavailable"
    STORE_ERROR = "store_error"
    # -- transports (connector) ------------------------------------------------------------------
    TRANSPORT_ERROR = "transport_error"
    TRANSPORT_BAD_REQUEST = "transport_bad_request"
    TRANSPORT_REGISTRATION_FAILED = "transport_registration_failed"
    TRANSPORT_CLOSED = "transport_closed"
    TRANSPORT_REMOTE_KV_MISSING = "transport_remote_kv_missing"
    TRANSPORT_ENGINE_ERROR = "transport_engine_error"
    TRANSPORT_PEER_UNREACHABLE = "transport_peer_unreachable"
    TRANSPORT_LINK_FAILED = "transport_link_failed"
    TRANSPORT_PULL_TIMEOUT = "transport_pull_timeout"
    # -- configuration (start-up) ----------------------------------------------------------------
    CONFIG_ERROR = "config_error"
    DEVICE_NOT_FOUND = "connector_device_unknown"
    RANKTABLE_INVALID = "ranktable_invalid"
    # -- anything else ---------------------------------------------------------------------------
    INTERNAL = "internal_error"


@dataclass(frozen=True)
class CodeInfo:
    status: int
    retryable: bool = False
    openai_type: str = "server_error"


_BAD = "invalid_request_error"

CODES: dict[Code, CodeInfo] = {
    Code.INVALID_REQUEST: CodeInfo(400, openai_type=_BAD),
    Code.VALIDATION_ERROR: CodeInfo(422, openai_type=_BAD),
    Code.MALFORMED_JSON: CodeInfo(400, openai_type=_BAD),
    Code.MULTIPLE_PROMPTS: CodeInfo(400, openai_type=_BAD),
    Code.UNSUPPORTED_BY_PD: CodeInfo(400, openai_type=_BAD),
    Code.CONTEXT_LENGTH_EXCEEDED: CodeInfo(400, openai_type=_BAD),
    Code.BODY_TOO_LARGE: CodeInfo(413, openai_type=_BAD),
    Code.REQUEST_TOO_LARGE: CodeInfo(413, openai_type=_BAD),
    Code.INVALID_API_KEY: CodeInfo(401, openai_type=_BAD),
    Code.UNAUTHORIZED: CodeInfo(401, openai_type=_BAD),
    Code.FORBIDDEN: CodeInfo(403, openai_type=_BAD),
    Code.NOT_FOUND: CodeInfo(404, openai_type=_BAD),
    Code.METHOD_NOT_ALLOWED: CodeInfo(405, openai_type=_BAD),
    Code.MODEL_NOT_FOUND: CodeInfo(404, openai_type=_BAD),
    Code.INSTANCE_NOT_FOUND: CodeInfo(404, openai_type=_BAD),
    Code.HANDOFF_NOT_FOUND: CodeInfo(404, openai_type=_BAD),
    Code.INVALID_CURSOR: CodeInfo(400, openai_type=_BAD),
    Code.TOO_MANY_REQUESTS: CodeInfo(429, retryable=True, openai_type="rate_limit_error"),
    Code.REQUEST_TIMEOUT: CodeInfo(408, openai_type=_BAD),
    Code.SERVER_BUSY: CodeInfo(503, retryable=True),
    Code.UPSTREAM_REJECTED: CodeInfo(400, openai_type=_BAD),
    Code.LOOP_DETECTED: CodeInfo(508, openai_type=_BAD),
    Code.HANDOFF_EXISTS: CodeInfo(409, openai_type=_BAD),
    Code.ILLEGAL_TRANSITION: CodeInfo(409, openai_type=_BAD),
    Code.HANDOFF_TERMINAL: CodeInfo(410, openai_type=_BAD),
    Code.PREFILL_FAILED: CodeInfo(502, retryable=True),
    Code.DECODE_FAILED: CodeInfo(502, retryable=True),
    Code.KV_EXPIRED: CodeInfo(504),
    Code.KV_NOT_READY: CodeInfo(504),
    Code.KV_LOAD_TIMEOUT: CodeInfo(504),
    Code.NO_COMPATIBLE_PAIR: CodeInfo(503),
    Code.NO_INSTANCE: CodeInfo(503, retryable=True),
    Code.OVERLOADED: CodeInfo(429, retryable=True, openai_type="rate_limit_error"),
    Code.UPSTREAM_TIMEOUT: CodeInfo(504, retryable=True),
    Code.METASERVER_UNAVAILABLE: CodeInfo(503, retryable=True),
    Code.BLOCK_PLAN_INVALID: CodeInfo(502),
    Code.TP_LAYOUT_UNSUPPORTED: CodeInfo(502),
    Code.INVALID_TRANSFER_PARAMS: CodeInfo(400, openai_type=_BAD),
    Code.LOCATION_MISMATCH: CodeInfo(502),
    Code.STORE_UNAVAILABLE: CodeInfo(503, retryable=True),
    Code.STORE_ERROR: CodeInfo(500),
    Code.TRANSPORT_ERROR: CodeInfo(502),
    Code.TRANSPORT_BAD_REQUEST: CodeInfo(502),
    Code.TRANSPORT_REGISTRATION_FAILED: CodeInfo(502),
    Code.TRANSPORT_CLOSED: CodeInfo(502),
    Code.TRANSPORT_REMOTE_KV_MISSING: CodeInfo(502),
    Code.TRANSPORT_ENGINE_ERROR: CodeInfo(502),
    Code.TRANSPORT_PEER_UNREACHABLE: CodeInfo(502, retryable=True),
    Code.TRANSPORT_LINK_FAILED: CodeInfo(502, retryable=True),
    Code.TRANSPORT_PULL_TIMEOUT: CodeInfo(504, retryable=True),
    Code.CONFIG_ERROR: CodeInfo(500),
    Code.DEVICE_NOT_FOUND: CodeInfo(500),
    Code.RANKTABLE_INVALID: CodeInfo(500),
    Code.INTERNAL: CodeInfo(500),
}


def info(code: Code | str) -> CodeInfo:
    """The table entry for a code; an unknown string (a newer peer's code) reads as INTERNAL."""
    try:
        return CODES[Code(code)]
    except ValueError:
        return CODES[Code.INTERNAL]


class PDGateError(Exception):
    """Base of every pdgate failure. Subclasses pin `code`; an instance may carry a more precise one."""

    code: ClassVar[Code] = Code.INTERNAL

    def __init__(self, message: str, *, code: Code | None = None, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]  # an instance may narrow its class's code
        self.context = context

    @property
    def status(self) -> int:
        return CODES[self.code].status

    @property
    def retryable(self) -> bool:
        return CODES[self.code].retryable

    @property
    def openai_type(self) -> str:
        return CODES[self.code].openai_type

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def map_exceptions(mapping: Mapping[type[BaseException], type[PDGateError]], **context: Any) -> Iterator[None]:
    """Re-raise a foreign exception as the pdgate error the boundary's table names (first match wins).

    Each boundary keeps its table next to the code that crosses it; errors that are already a
    `PDGateError`, and exceptions the table does not list, pass through unchanged.
    """
    try:
        yield
    except PDGateError:
        raise
    except Exception as exc:
        for from_type, to_type in mapping.items():
            if isinstance(exc, from_type):
                raise to_type(str(exc) or type(exc).__name__, **context) from exc
        raise

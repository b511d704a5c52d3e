"""pdgate's one error vocabulary: every failure any component reports has a `Code` from this table.

Why one table: the router, the metaserver, the connector and the transports used to keep five
exception trees that were translated into each other by hand, and the connector matched error
strings. Now each failure is a `PDGateError` carrying a `Code`; the code alone decides the HTTP
status, the OpenAI error `type`, and whether a retry elsewhere can help. Each boundary (HTTP answer
-> client exception, transport exception -> pull outcome, metaserver error -> router error) has one
mapping table next to the code that crosses it, in the manner of httpx's `_transports/default.py`:
`pdgate.meta_client.BY_STATUS` and `TRANSPORT_ERRORS`, the router's `UPSTREAM_FAILURES` and
`META_FAILURES` (applied by `pdgate.router.errors.translate`, the one translation of a foreign failure).

    PDGateError                 code -> (status, retryable, OpenAI type): the code's own entry
    └── one subclass per package where callers catch a family (pdgate.meta_client.MetaError,
        pdgate.router.errors.RouterError, pdgate.connector.transport.errors.TransportError, ...)

`retryable` means "the same operation may succeed on another instance or a bit later"; the router's
retry loop and the connector's control thread read it, and nothing else decides retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

__all__ = ["CODES", "Code", "CodeInfo", "PDGateError", "info"]


@dataclass(frozen=True)
class CodeInfo:
    status: int
    retryable: bool = False
    openai_type: str = "server_error"


_BAD = "invalid_request_error"


class Code(str, Enum):
    """Stable machine codes. Clients and dashboards key on these strings: never rename one.

    Each member carries its table entry on its own line (HTTP status, retryable, OpenAI type), so a
    new code cannot be added without deciding what it means to a client.
    """

    _value_: str
    entry: CodeInfo

    def __new__(cls, value: str, entry: CodeInfo | None = None) -> Code:
        # Runs once per member at class creation; `Code("pd_overloaded")` looks a member up instead.
        if entry is None:
            raise TypeError(f"code {value!r} needs its CodeInfo: what it means to a client is part of the code")
        member = str.__new__(cls, value)
        member._value_ = value
        member.entry = entry
        return member

    if TYPE_CHECKING:  # a custom __new__ hides the member values' type from mypy: they are the strings

        @property
        def value(self) -> str: ...

    # -- request refused before any work (client's fault) ---------------------------------------
    INVALID_REQUEST = "invalid_request", CodeInfo(400, openai_type=_BAD)
    VALIDATION_ERROR = "validation_error", CodeInfo(422, openai_type=_BAD)
    MALFORMED_JSON = "malformed_json", CodeInfo(400, openai_type=_BAD)
    # no longer sent (prompts fan out); kept: codes are never reused
    MULTIPLE_PROMPTS = "multiple_prompts_unsupported", CodeInfo(400, openai_type=_BAD)
    # a field PD disaggregation cannot serve (param names it)
    UNSUPPORTED_BY_PD = "pd_unsupported_parameter", CodeInfo(400, openai_type=_BAD)
    # OpenAI's code: longer than the model's max_model_len
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded", CodeInfo(400, openai_type=_BAD)
    BODY_TOO_LARGE = "body_too_large", CodeInfo(413, openai_type=_BAD)
    REQUEST_TOO_LARGE = "request_too_large", CodeInfo(413, openai_type=_BAD)
    URL_TOO_LONG = "url_too_long", CodeInfo(414, openai_type=_BAD)  # refused by pdgate.serving as it arrives
    HEADERS_TOO_LARGE = "headers_too_large", CodeInfo(431, openai_type=_BAD)  # the same, for the request head
    INVALID_API_KEY = "invalid_api_key", CodeInfo(401, openai_type=_BAD)
    UNAUTHORIZED = "unauthorized", CodeInfo(401, openai_type=_BAD)
    FORBIDDEN = "forbidden", CodeInfo(403, openai_type=_BAD)
    NOT_FOUND = "not_found", CodeInfo(404, openai_type=_BAD)
    METHOD_NOT_ALLOWED = "method_not_allowed", CodeInfo(405, openai_type=_BAD)
    MODEL_NOT_FOUND = "model_not_found", CodeInfo(404, openai_type=_BAD)
    INSTANCE_NOT_FOUND = "instance_not_found", CodeInfo(404, openai_type=_BAD)
    HANDOFF_NOT_FOUND = "handoff_not_found", CodeInfo(404, openai_type=_BAD)
    INVALID_CURSOR = "invalid_cursor", CodeInfo(400, openai_type=_BAD)
    TOO_MANY_REQUESTS = "too_many_requests", CodeInfo(429, retryable=True, openai_type="rate_limit_error")
    REQUEST_TIMEOUT = "request_timeout", CodeInfo(408, openai_type=_BAD)  # the client did not send its headers in time
    SERVER_BUSY = "server_busy", CodeInfo(503, retryable=True)  # connection limit reached; retry shortly
    UPSTREAM_REJECTED = "upstream_rejected", CodeInfo(400, openai_type=_BAD)  # an engine's own 4xx
    LOOP_DETECTED = "pd_loop_detected", CodeInfo(508, openai_type=_BAD)
    # -- ledger state ---------------------------------------------------------------------------
    HANDOFF_EXISTS = "handoff_exists", CodeInfo(409, openai_type=_BAD)
    ILLEGAL_TRANSITION = "illegal_transition", CodeInfo(409, openai_type=_BAD)
    HANDOFF_TERMINAL = "handoff_terminal", CodeInfo(410, openai_type=_BAD)
    # -- the disaggregated path failed (pd_*) ---------------------------------------------------
    PREFILL_FAILED = "pd_prefill_failed", CodeInfo(502, retryable=True)
    DECODE_FAILED = "pd_decode_failed", CodeInfo(502, retryable=True)
    KV_EXPIRED = "pd_kv_expired", CodeInfo(504)
    KV_NOT_READY = "pd_kv_not_ready", CodeInfo(504)  # a decode's claim found no READY handoff in time
    KV_LOAD_TIMEOUT = "pd_kv_timeout", CodeInfo(504)  # a decode's KV load outlived its deadline
    NO_COMPATIBLE_PAIR = "pd_no_compatible_pair", CodeInfo(503)
    # no instance of the model answered a route the router passes through
    NO_INSTANCE = "pd_no_instance", CodeInfo(503, retryable=True)
    OVERLOADED = "pd_overloaded", CodeInfo(429, retryable=True, openai_type="rate_limit_error")
    UPSTREAM_TIMEOUT = "pd_upstream_timeout", CodeInfo(504, retryable=True)
    METASERVER_UNAVAILABLE = "pd_metaserver_unavailable", CodeInfo(503, retryable=True)
    # The metaserver refused the router itself (401/403: a wrong token; 400/422: router and metaserver
    # disagree). No outage and no client's fault: 503 because the service cannot serve as configured,
    # and not retryable (every instance and every retry meets the same refusal): its own code tells
    # the operator to fix the router's or the metaserver's settings instead of waiting for a recovery.
    METASERVER_MISCONFIGURED = "pd_metaserver_misconfigured", CodeInfo(503)
    BLOCK_PLAN_INVALID = "pd_block_plan_invalid", CodeInfo(502)
    TP_LAYOUT_UNSUPPORTED = "pd_tp_layout_unsupported", CodeInfo(502)
    INVALID_TRANSFER_PARAMS = "pd_invalid_transfer_params", CodeInfo(400, openai_type=_BAD)
    LOCATION_MISMATCH = "pd_location_mismatch", CodeInfo(502)
    # -- the store ------------------------------------------------------------------------------
    STORE_UNAVAILABLE = "store_unavailable", CodeInfo(503, retryable=True)
    STORE_ERROR = "store_error", CodeInfo(500)
    # -- transports (connector) ------------------------------------------------------------------
    TRANSPORT_ERROR = "transport_error", CodeInfo(502)
    TRANSPORT_BAD_REQUEST = "transport_bad_request", CodeInfo(502)
    TRANSPORT_REGISTRATION_FAILED = "transport_registration_failed", CodeInfo(502)
    TRANSPORT_CLOSED = "transport_closed", CodeInfo(502)
    TRANSPORT_REMOTE_KV_MISSING = "transport_remote_kv_missing", CodeInfo(502)
    TRANSPORT_ENGINE_ERROR = "transport_engine_error", CodeInfo(502)
    TRANSPORT_PEER_UNREACHABLE = "transport_peer_unreachable", CodeInfo(502, retryable=True)
    TRANSPORT_LINK_FAILED = "transport_link_failed", CodeInfo(502, retryable=True)
    TRANSPORT_PULL_TIMEOUT = "transport_pull_timeout", CodeInfo(504, retryable=True)
    # -- configuration (start-up) ----------------------------------------------------------------
    CONFIG_ERROR = "config_error", CodeInfo(500)
    DEVICE_NOT_FOUND = "connector_device_unknown", CodeInfo(500)
    RANKTABLE_INVALID = "ranktable_invalid", CodeInfo(500)
    # -- anything else ---------------------------------------------------------------------------
    INTERNAL = "internal_error", CodeInfo(500)


CODES: dict[Code, CodeInfo] = {code: code.entry for code in Code}
"""The table as a mapping, for callers that look an entry up by code."""


def info(code: Code | str) -> CodeInfo:
    """The table entry for a code; an unknown string (a newer peer's code) reads as INTERNAL."""
    try:
        return Code(code).entry
    except ValueError:
        return Code.INTERNAL.entry


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
        return self.code.entry.status

    @property
    def retryable(self) -> bool:
        return self.code.entry.retryable

    @property
    def openai_type(self) -> str:
        return self.code.entry.openai_type

    def __str__(self) -> str:
        return self.message

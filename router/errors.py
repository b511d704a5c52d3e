"""Every way a proxied request can fail, and the two ways to render one to the client.

Each class pins a `pdgate.errors.Code`; status, OpenAI `type` and `retryable` come from `CODES`, so the
router's retry loop (`pdgate.router.retry`) and the wire format read the same table.

    RouterError(PDGateError)
    ├── BadRequest                   400 invalid_request (body not JSON, a field of the wrong type, ...)
    │   ├── UnsupportedByPD          400 pd_unsupported_parameter (`param` names the field: best_of, n, ...)
    │   └── ContextTooLong           400 context_length_exceeded (past the model's max_model_len)
    ├── Unauthorized                 401 invalid_api_key
    ├── MethodNotAllowed             405 method_not_allowed
    ├── ModelNotFound                404 model_not_found
    ├── RouteNotServed               404 not_found (no route, or no instance serves this vLLM route)
    ├── PayloadTooLarge              413 request_too_large
    ├── UpstreamRejected             an engine's own 4xx answer: its status and words, upstream_rejected
    └── PDError                      the pd_* family: the disaggregated path itself failed
        ├── PrefillFailed            502 pd_prefill_failed (retryable)
        ├── DecodeFailed             502 pd_decode_failed (retryable)
        ├── KVExpired                504 pd_kv_expired (the handoff lapsed before a decode claimed it)
        ├── KVNotReady               504 pd_kv_not_ready (the prefill answered; its READY never came)
        ├── NoCompatiblePair         503 pd_no_compatible_pair (the message says why)
        ├── NoInstance               503 pd_no_instance (a passed-through route: no instance answered)
        ├── Overloaded               429 pd_overloaded (with Retry-After)
        ├── UpstreamTimeout          504 pd_upstream_timeout (retryable)
        ├── MetaserverUnavailable    503 pd_metaserver_unavailable (retryable: an outage)
        └── MetaserverMisconfigured  503 pd_metaserver_misconfigured (the metaserver refused the router)

Before the response has started, an error is an OpenAI error body (`{"error": {message, type, code,
param}}`) with the code also in the `X-PDGate-Error` header. Once an SSE stream has started it is one
`data: {"error": {...}}` event followed by `data: [DONE]`: the openai client raises `APIError` on
an event whose JSON has an "error" key, and clients that read until [DONE] still terminate.

The boundary tables live here too: `UPSTREAM_FAILURES` (what an exception while talking to an engine
becomes, per side) and `META_FAILURES` (what a `MetaClient` error becomes), both applied by `translate`,
the router's one translation of a foreign failure.

What a client reads about an engine's failure names the role and an opaque name (`Where.public`,
`pool.Pool.public_name`), never the instance id (which defaults to the engine's address) nor the
engine's own words: those are the error's `detail` (`failed`, `detail`), which the log and the admin
read. An engine's 4xx is the exception: it is the client's own error, so the client reads the engine's
message (and `param`) with the engine's status, in pdgate's shape with `X-PDGate-Error: upstream_rejected`
(issue #26: a relayed vLLM body had neither the header nor pdgate's `code`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NamedTuple

import orjson

from pdgate.errors import Code, PDGateError
from pdgate.meta_client import MetaBadRequest, MetaError, MetaUnauthorized
from pdgate.upstream import ReadTimeout

__all__ = [
    "ERROR_HEADER",
    "META_FAILURES",
    "UPSTREAM_FAILURES",
    "BadRequest",
    "ContextTooLong",
    "DecodeFailed",
    "KVExpired",
    "KVNotReady",
    "MetaserverMisconfigured",
    "MetaserverUnavailable",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoCompatiblePair",
    "NoInstance",
    "Overloaded",
    "PDError",
    "PayloadTooLarge",
    "PrefillFailed",
    "RouteNotServed",
    "RouterError",
    "Side",
    "Unauthorized",
    "UnsupportedByPD",
    "UpstreamRejected",
    "UpstreamTimeout",
    "Where",
    "detail",
    "engine_message",
    "error_body",
    "error_headers",
    "failed",
    "snippet",
    "sse_error",
    "translate",
]

ERROR_HEADER = b"x-pdgate-error"
JSON = b"application/json"

Side = Literal["prefill", "decode"]


class RouterError(PDGateError):
    """A failure the router answers with; `body()` and `headers()` are its wire form."""

    code: ClassVar[Code] = Code.INTERNAL
    param: str | None = None  # the request field the error is about, as OpenAI's and vLLM's errors name it

    def body(self) -> bytes:
        return error_body(self.message, self.openai_type, self.code.value, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return error_headers(self.code.value)


class BadRequest(RouterError):
    code = Code.INVALID_REQUEST


class UnsupportedByPD(BadRequest):
    """A field that prefill/decode disaggregation cannot serve (beam search, best_of, ...): refused before
    any engine work, naming the field, instead of an engine failure later."""

    code = Code.UNSUPPORTED_BY_PD

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(BadRequest):
    """A request the engines would refuse for the model's max_model_len, refused before the prefill."""

    code = Code.CONTEXT_LENGTH_EXCEEDED

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RouteNotServed(RouterError):
    code = Code.NOT_FOUND


class Unauthorized(RouterError):
    code = Code.INVALID_API_KEY


class MethodNotAllowed(RouterError):
    code = Code.METHOD_NOT_ALLOWED


class ModelNotFound(RouterError):
    code = Code.MODEL_NOT_FOUND


class PayloadTooLarge(RouterError):
    code = Code.REQUEST_TOO_LARGE


def snippet(data: bytes, n: int = 300) -> str:
    """The start of an engine's answer, for an error message."""
    text = data[:n].decode("utf-8", "replace")
    return text + ("..." if len(data) > n else "")


class UpstreamRejected(RouterError):
    """An engine refused the request (4xx): the client's own error, answered with the engine's status and
    message (and `param`) as an OpenAI error of code upstream_rejected, as every router error is."""

    code = Code.UPSTREAM_REJECTED

    def __init__(self, status: int, body: bytes, content_type: bytes | None) -> None:
        message, param = engine_message(body)
        super().__init__(message or f"engine answered {status}")
        self.param = param
        self.upstream_status = status
        self.upstream_body = body  # as the engine wrote it, for a log or a test
        self.content_type = content_type or JSON

    @property
    def status(self) -> int:
        return self.upstream_status


def engine_message(body: bytes) -> tuple[str, str | None]:
    """The message and `param` of an engine's error body: vLLM's `{"error": {"message", "param", ...}}`,
    its older flat `{"object": "error", "message", ...}`, a plain string error, else the body's start."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return snippet(body).strip(), None
    inner = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(inner, str):
        return inner, None
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        param = inner.get("param")
        return inner["message"], param if isinstance(param, str) else None
    return snippet(body), None


class PDError(RouterError):
    """The family of failures of the disaggregated path itself (logged at WARNING)."""


class PrefillFailed(PDError):
    code = Code.PREFILL_FAILED


class DecodeFailed(PDError):
    code = Code.DECODE_FAILED


class KVExpired(PDError):
    code = Code.KV_EXPIRED


class KVNotReady(PDError):
    code = Code.KV_NOT_READY

    @classmethod
    def never_ready(cls, where: tuple[str, str], transfer_id: str, waited_s: float, refusal: str) -> KVNotReady:
        """The prefill answered with `kv_transfer_params` naming the handoff, yet the router's ledger still
        holds it PENDING once the claim wait is over: its READY went to another ledger (a PDGateConnector
        records at its own kv_connector_extra_config metaserver_url and ignores the one the router names)
        or was refused there. No decode can claim it here; sending one only turned this into "decode ...
        answered 500" (issue #26 item 6), so it is not retried on another decode either. With
        `--whole-on-failure` (the default) the request is then served whole (`router/whole.py`, counted as
        `kv_not_ready`) and the client gets its answer; this error's text goes to the log. `where`:
        `pool.LiveInstance.where` of the prefill, (client's words, the log's)."""
        why = (
            f"answered with kv_transfer_params for transfer {transfer_id}, but its handoff stayed PENDING in "
            f"this router's ledger for {waited_s:g}s: the prefill likely reports its handoffs to another "
            "metaserver (check metaserver_url in its kv_connector_extra_config, or "
            "PDGATE_CONNECTOR_METASERVER_URL: it must be this router's metaserver), or its metaserver refuses "
            "its token"
        )
        return cls(f"{where[0]} {why}", detail=f"{where[1]} {why} ({refusal})")


class NoCompatiblePair(PDError):
    code = Code.NO_COMPATIBLE_PAIR


class Overloaded(PDError):
    code = Code.OVERLOADED

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*error_headers(self.code.value), (b"retry-after", str(self.retry_after_s).encode())]


class NoInstance(PDError):
    code = Code.NO_INSTANCE


class UpstreamTimeout(PDError):
    code = Code.UPSTREAM_TIMEOUT


class MetaserverUnavailable(PDError):
    code = Code.METASERVER_UNAVAILABLE


class MetaserverMisconfigured(PDError):
    """The metaserver refused the router itself: a wrong token (401/403) or a request it will never take
    (400/413/422: router and metaserver disagree). A configuration error, said as one: no retry, no
    outage, and the message names the settings to check."""

    code = Code.METASERVER_MISCONFIGURED

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(
            f"{message} (a configuration error, not an outage: check the router's metaserver token, "
            "--metaserver-token-file or the admin token, and that router and metaserver run the same version)",
            **context,
        )


# What any exception while connecting to, sending to or reading from one engine becomes: a failure of
# that instance (breaker, retry elsewhere), never a bare 500. First match wins.
UPSTREAM_FAILURES: Mapping[Side, Mapping[type[BaseException], type[RouterError]]] = {
    "prefill": {ReadTimeout: UpstreamTimeout, Exception: PrefillFailed},
    "decode": {ReadTimeout: UpstreamTimeout, Exception: DecodeFailed},
}

# What a metaserver client error becomes when the proxy needs the ledger to go on. First match wins: a
# refusal of the router itself is its configuration, anything else an outage.
META_FAILURES: Mapping[type[BaseException], type[RouterError]] = {
    MetaUnauthorized: MetaserverMisconfigured,
    MetaBadRequest: MetaserverMisconfigured,
    MetaError: MetaserverUnavailable,
}


class Where(NamedTuple):
    """Who failed: `public` as a client reads it (a role and an opaque name), `internal` as the log and
    the admin read it (the instance id too). `pool.LiveInstance.where` makes one."""

    public: str
    internal: str


def failed(cls: type[RouterError], where: Where, what: str, engine_said: str = "") -> RouterError:
    """`cls` telling the client that `where` `what` (a sentence of the router's own); the detail for the
    log adds the instance id and `engine_said` (the engine's own words, which a client never reads)."""
    internal = f"{where.internal} {what}" + (f": {engine_said}" if engine_said else "")
    return cls(f"{where.public} {what}", detail=internal)


def detail(err: PDGateError) -> str:
    """What the log says about `err`: its detail (instance ids, an engine's words) or else its message."""
    found = err.context.get("detail")
    return found if isinstance(found, str) else err.message


def translate(
    exc: BaseException, table: Mapping[type[BaseException], type[RouterError]], where: str | Where
) -> RouterError:
    """The router error `table` names for `exc`, its message prefixed with `where` (who failed). With a
    `Where` (an engine failed) the client reads the exception's type only and the detail holds its words
    (they may name the engine's address); with a plain string the message carries them.

    It also maps other packages' `PDGateError`s (a `MetaError` is one), because a boundary decides what
    a foreign failure means to its own caller; a `RouterError` is already the router's and passes.
    """
    if isinstance(exc, RouterError):
        return exc
    for from_type, to_type in table.items():
        if isinstance(exc, from_type):
            said = str(exc)
            if not type(exc).__module__.startswith("pdgate."):  # not one of ours: name its type
                said = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
            if isinstance(where, Where):
                err = to_type(f"{where.public}: {type(exc).__name__}", detail=f"{where.internal}: {said}")
            else:
                err = to_type(f"{where}: {said}")
            err.__cause__ = exc
            return err
    raise exc


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": param}})


def error_headers(code: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", JSON), (ERROR_HEADER, code.encode())]


def sse_error(err: RouterError) -> bytes:
    """The terminal SSE events for a stream that already started."""
    return b"data: " + error_body(err.message, err.openai_type, err.code.value, err.param) + b"\n\ndata: [DONE]\n\n"

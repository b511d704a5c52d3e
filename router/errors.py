"""Every way a proxied request can fail, each with a stable `code`, and the two ways to render one.

    RouterError                      code, status, type, retryable
    ├── BadRequest                   400 invalid_request_error (body not JSON, several prompts, ...)
    ├── Unauthorized                 401 invalid_api_key
    ├── MethodNotAllowed             405 method_not_allowed
    ├── ModelNotFound                404 model_not_found
    ├── PayloadTooLarge              413 request_too_large
    ├── UpstreamRejected             an engine's own 4xx answer, relayed verbatim (not a PD failure)
    └── PDError                      the pd_* family: the disaggregated path itself failed
        ├── PrefillFailed            502 pd_prefill_failed
        ├── DecodeFailed             502 pd_decode_failed
        ├── KVExpired                504 pd_kv_expired (the handoff lapsed before a decode claimed it)
        ├── NoCompatiblePair         503 pd_no_compatible_pair (the message says why)
        ├── Overloaded               429 pd_overloaded (with Retry-After)
        ├── UpstreamTimeout          504 pd_upstream_timeout
        └── MetaserverUnavailable    503 pd_metaserver_unavailable

Before the response has started, an error is an OpenAI error body (`{"error": {message, type, code,
param}}`) with the code also in the `X-PDGate-Error` header. Once an SSE stream has started it is one
`data: {"error": {...}}` event followed by `data: [DONE]`: the openai client raises `APIError` on
an event whose JSON has an "error" key, and clients that read until [DONE] still terminate.
"""

from __future__ import annotations

from typing import ClassVar

import orjson

__all__ = [
    "ERROR_HEADER",
    "BadRequest",
    "DecodeFailed",
    "KVExpired",
    "MetaserverUnavailable",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoCompatiblePair",
    "Overloaded",
    "PDError",
    "PayloadTooLarge",
    "PrefillFailed",
    "RouterError",
    "Unauthorized",
    "UpstreamRejected",
    "UpstreamTimeout",
    "error_body",
    "error_headers",
    "sse_error",
]

ERROR_HEADER = b"x-pdgate-error"
JSON = b"application/json"


class RouterError(Exception):
    code: ClassVar[str] = "router_error"
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return error_headers(self.code)


class BadRequest(RouterError):
    code, status, type = "invalid_request", 400, "invalid_request_error"


class Unauthorized(RouterError):
    code, status, type = "invalid_api_key", 401, "invalid_request_error"


class MethodNotAllowed(RouterError):
    code, status, type = "method_not_allowed", 405, "invalid_request_error"


class ModelNotFound(RouterError):
    code, status, type = "model_not_found", 404, "invalid_request_error"


class PayloadTooLarge(RouterError):
    code, status, type = "request_too_large", 413, "invalid_request_error"


class UpstreamRejected(RouterError):
    """An engine refused the request (4xx): the client's own error, relayed with the engine's body."""

    code, type = "upstream_rejected", "invalid_request_error"

    def __init__(self, status: int, body: bytes, content_type: bytes | None) -> None:
        super().__init__(f"engine answered {status}")
        self.upstream_status = status
        self.upstream_body = body
        self.content_type = content_type or JSON

    def body(self) -> bytes:
        return self.upstream_body

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", self.content_type)]


class PDError(RouterError):
    code = "pd_error"
    status = 502


class PrefillFailed(PDError):
    code, status, retryable = "pd_prefill_failed", 502, True


class DecodeFailed(PDError):
    code, status, retryable = "pd_decode_failed", 502, True


class KVExpired(PDError):
    code, status = "pd_kv_expired", 504


class NoCompatiblePair(PDError):
    code, status = "pd_no_compatible_pair", 503


class Overloaded(PDError):
    code, status, type, retryable = "pd_overloaded", 429, "rate_limit_error", True

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*error_headers(self.code), (b"retry-after", str(self.retry_after_s).encode())]


class UpstreamTimeout(PDError):
    code, status, retryable = "pd_upstream_timeout", 504, True


class MetaserverUnavailable(PDError):
    code, status, retryable = "pd_metaserver_unavailable", 503, True


def error_body(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": None}})


def error_headers(code: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", JSON), (ERROR_HEADER, code.encode())]


def sse_error(err: RouterError) -> bytes:
    """The terminal SSE events for a stream that already started."""
    return b"data: " + error_body(err.message, err.type, err.code) + b"\n\ndata: [DONE]\n\n"

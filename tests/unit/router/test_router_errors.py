"""errors.py: every typed error renders as OpenAI error JSON with its code in a header, or as SSE."""

from __future__ import annotations

import orjson
import pytest
from pdgate.router.errors import (
    ERROR_HEADER,
    META_FAILURES,
    UPSTREAM_FAILURES,
    DecodeFailed,
    KVExpired,
    MetaserverUnavailable,
    NoCompatiblePair,
    Overloaded,
    PrefillFailed,
    UpstreamRejected,
    UpstreamTimeout,
    sse_error,
    translate,
)

from pdgate.errors import PDGateError
from pdgate.meta_client import MetaUnavailable
from pdgate.upstream import ConnectFailed, ConnectionClosed, ReadTimeout


@pytest.mark.parametrize(
    ("err", "status", "code"),
    [
        (PrefillFailed("x"), 502, "pd_prefill_failed"),
        (DecodeFailed("x"), 502, "pd_decode_failed"),
        (KVExpired("x"), 504, "pd_kv_expired"),
        (NoCompatiblePair("x"), 503, "pd_no_compatible_pair"),
        (Overloaded("x"), 429, "pd_overloaded"),
        (UpstreamTimeout("x"), 504, "pd_upstream_timeout"),
        (MetaserverUnavailable("x"), 503, "pd_metaserver_unavailable"),
    ],
)
def test_openai_shape_and_header(err, status: int, code: str) -> None:
    assert err.status == status and err.code.value == code and isinstance(err, PDGateError)
    body = orjson.loads(err.body())
    assert body == {"error": {"message": "x", "type": err.openai_type, "code": code, "param": None}}
    assert (ERROR_HEADER, code.encode()) in err.headers()


def test_overloaded_says_when_to_retry() -> None:
    assert (b"retry-after", b"3") in Overloaded("busy", retry_after_s=3).headers()


def test_sse_error_is_one_error_event_then_done() -> None:
    raw = sse_error(DecodeFailed("broke"))
    events = raw.split(b"\n\n")
    assert events[0].startswith(b"data: ") and events[1] == b"data: [DONE]" and events[2] == b""
    assert orjson.loads(events[0][6:])["error"]["code"] == "pd_decode_failed"


@pytest.mark.parametrize(
    ("engine_body", "message", "param"),
    [
        (
            b'{"error": {"message": "too long", "type": "BadRequestError", "param": "max_tokens", "code": 400}}',
            "too long",
            "max_tokens",
        ),
        (
            b'{"object": "error", "message": "too long", "type": "BadRequestError", "param": null, "code": 400}',
            "too long",
            None,
        ),
        (b'{"error": "too long"}', "too long", None),
        (b"too long", "too long", None),
    ],
)
def test_upstream_rejection_is_pdgates_shape_with_the_engines_words(
    engine_body: bytes, message: str, param: str | None
) -> None:
    err = UpstreamRejected(400, engine_body, b"application/json")
    want = {"message": message, "type": "invalid_request_error", "code": "upstream_rejected", "param": param}
    assert orjson.loads(err.body()) == {"error": want}
    assert (b"x-pdgate-error", b"upstream_rejected") in err.headers()


def test_upstream_rejection_answers_with_the_engines_status() -> None:
    assert UpstreamRejected(422, b"{}", None).status == 422


@pytest.mark.parametrize(
    ("side", "exc", "code"),
    [
        ("prefill", ReadTimeout("no answer within 1 s"), "pd_upstream_timeout"),
        ("prefill", ConnectFailed("refused"), "pd_prefill_failed"),
        ("decode", ConnectionClosed("reset"), "pd_decode_failed"),
        ("decode", ValueError("Port out of range 0-65535"), "pd_decode_failed"),
        ("decode", UnicodeError("label too long"), "pd_decode_failed"),
    ],
)
def test_any_exception_from_an_instance_is_that_instances_retryable_failure(
    side: str, exc: Exception, code: str
) -> None:
    err = translate(exc, UPSTREAM_FAILURES[side], f"{side} i1")  # type: ignore[index]
    assert err.code.value == code and err.retryable and err.message.startswith(f"{side} i1: ")
    assert err.__cause__ is exc
    if not isinstance(exc, (ReadTimeout, ConnectFailed, ConnectionClosed)):
        assert type(exc).__name__ in err.message  # a foreign exception is named


def test_a_metaserver_failure_is_pd_metaserver_unavailable() -> None:
    err = translate(MetaUnavailable("connection refused"), META_FAILURES, "cannot record the handoff")
    assert (
        err.code.value == "pd_metaserver_unavailable" and err.message == "cannot record the handoff: connection refused"
    )

"""streaming.py: which SSE bytes are an engine's own error event (and which only mention the word)."""

from __future__ import annotations

from pdgate.router.streaming import engine_error, is_sse

TOKEN = b'data: {"choices":[{"index":0,"text":"error"}]}\n\n'
ERROR = b'data: {"error":{"message":"Internal server error","type":"InternalServerError","code":500}}\n\n'


def test_an_error_event_is_found_where_it_starts() -> None:
    assert engine_error(ERROR) == (0, "Internal server error")
    assert engine_error(TOKEN + ERROR + b"data: [DONE]\n\n") == (len(TOKEN), "Internal server error")
    assert engine_error(b'data: {"error":"plain text"}\n\n') == (0, "plain text")


def test_text_that_says_error_is_not_an_error_event() -> None:
    assert engine_error(TOKEN) is None
    assert engine_error(b'data: {"choices":[{"text":"data: {\\"error\\": 1}"}]}\n\n') is None
    assert engine_error(ERROR[:-2]) is None  # an event cut by the chunk boundary is not judged


def test_sse_content_type() -> None:
    assert is_sse(b"text/event-stream; charset=utf-8") and is_sse(b"Text/Event-Stream")
    assert not is_sse(b"application/json") and not is_sse(None)

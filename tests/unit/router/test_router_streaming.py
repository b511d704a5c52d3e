"""streaming.py: which SSE bytes are an engine's own error event (and which only mention the word)."""

from __future__ import annotations

from typing import Any

from pdgate.router.streaming import engine_error, is_sse, relay_stream

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


class _Upstream:
    """A decode's streamed answer, chunk by chunk (the `UpstreamResponse` protocol's part the relay reads)."""

    status = 200

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    def header(self, name: bytes) -> bytes | None:
        return None

    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        return self._chunks.pop(0) if self._chunks else None


async def test_the_answer_counts_as_ended_before_its_done_event_goes_out() -> None:
    """A client that hangs up once it has read `[DONE]` (the openai client does) has the whole answer: the
    request must be marked ended before that event is sent, or the hang-up reads as leaving mid-stream."""
    events: list[str] = []
    ended = False

    def before_end() -> None:
        nonlocal ended
        ended = True
        events.append("end")

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body" and msg.get("body"):
            events.append("done" if b"[DONE]" in msg["body"] else "token")

    upstream = _Upstream([b"data: [DONE]\n\n"])
    error = await relay_stream(send, upstream, TOKEN, [], 1.0, before_end, "decode d0")  # type: ignore[arg-type]
    assert error is None and ended
    assert events[:3] == ["token", "end", "done"]

"""Relaying a decode's answer to the client: raw ASGI sends, no buffering of streams.

The stream is not parsed. Before the status line goes out the decode must have answered
`text/event-stream` (`pdgate.router.attempts` checks it, while another decode can still be tried).
After that, three cheap checks decide how it ended: the transport (the decode's connection closed,
went silent or failed in any other way before the end of the HTTP body), the engine's own error event
(vLLM ends a stream whose generation failed with `data: {"error": ...}`; only a chunk that contains
`"error"` is looked at more closely) and the last bytes (an SSE body must end with `data: [DONE]`).
A stream that breaks gets one terminal SSE error event (`pd_decode_failed`), so a client never
mistakes a truncated answer for a complete one, and always gets a pdgate code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import orjson
from pdgate.router.errors import UPSTREAM_FAILURES, DecodeFailed, RouterError, Where, failed, sse_error, translate

from pdgate.asgi import Send
from pdgate.upstream import UpstreamResponse

__all__ = ["SSE", "Garbage", "end_stream", "engine_error", "is_sse", "relay_stream", "send_body", "send_error"]

SSE = b"text/event-stream"


class Garbage(Exception):
    """Raised by a resumable stream's send (`resume.StreamTrack`) for an event that is not JSON: the
    engine's failure, and the stream goes on elsewhere."""


_TAIL = 32


def is_sse(content_type: bytes | None) -> bool:
    return content_type is not None and content_type[: len(SSE)].lower() == SSE


def engine_error(chunk: bytes) -> tuple[int, str] | None:
    """(offset, message) of the first complete SSE event in `chunk` whose JSON object has an "error" key
    (the engine reporting that the request failed mid-stream), or None."""
    pos = 0
    while (start := chunk.find(b"data: {", pos)) >= 0:
        end = chunk.find(b"\n\n", start)
        if end < 0:
            return None
        try:
            event = orjson.loads(chunk[start + 6 : end])
        except orjson.JSONDecodeError:
            event = None  # "data: {" inside some text, not an event
        if isinstance(event, dict) and "error" in event:
            err = event["error"]
            message = err.get("message") if isinstance(err, dict) else err
            return start, str(message)
        pos = end + 2
    return None


async def send_body(
    send: Send, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes, before_end: Callable[[], None]
) -> None:
    """One complete response (status, headers, body)."""
    hdrs = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    before_end()
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, err: RouterError, extra: Sequence[tuple[bytes, bytes]], before_end: Callable[[], None]
) -> None:
    await send_body(send, err.status, [*err.headers(), *extra], err.body(), before_end)


async def relay_stream(
    send: Send,
    resp: UpstreamResponse,
    first: bytes | None,
    headers: Sequence[tuple[bytes, bytes]],
    idle_timeout: float,
    before_end: Callable[[], None],
    where: Where,
    *,
    resumable: bool = False,
) -> RouterError | None:
    """Relay a 200 SSE answer whose first body bytes (`first`) were already read.

    Returns None when the stream ended as it should, else the error that was sent as the last event.
    `where` names the decode in that error; what the engine said goes to its detail (the log), not to the client.
    `resumable`: a broken stream is left open, without the error event, for the caller to resume
    elsewhere (`whole.Whole.resume`) or end.
    """
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    tail = b""
    error: RouterError | None = None
    chunk = first
    while chunk is not None:
        if b'"error"' in chunk and (found := engine_error(chunk)) is not None:
            at, message = found
            if at:
                await send({"type": "http.response.body", "body": chunk[:at], "more_body": True})
            error = failed(DecodeFailed, where, "failed the request mid-stream", message)
            break
        tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
        if tail.rstrip().endswith(b"[DONE]"):
            # The answer is whole once this goes out: a client that hangs up after reading it (the openai
            # client does, at [DONE]) has everything, and must not be taken for one that left mid-stream
            # (which would abort a handoff the decode is finishing).
            before_end()
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Garbage as exc:  # a resumable stream's send found an event that is not one (`resume`)
            error = failed(DecodeFailed, where, "answered an event that is not JSON mid-stream", str(exc))
            break
        try:
            chunk = await resp.next_chunk(idle_timeout)
        except Exception as exc:  # whatever the decode's connection did, it is the decode's failure
            error = translate(
                exc,
                UPSTREAM_FAILURES["decode"],
                Where(f"{where.public}: stream broke", f"{where.internal}: stream broke"),
            )
            break
    if error is None and not tail.rstrip().endswith(b"[DONE]"):
        error = failed(DecodeFailed, where, "ended its stream without [DONE]")
    if error is not None and resumable:
        return error
    await end_stream(send, error, before_end)
    return error


async def end_stream(send: Send, error: RouterError | None, before_end: Callable[[], None]) -> None:
    """The last message of a started stream: the terminal error events (`sse_error`) when it failed.
    `before_end` may have run already (at `[DONE]`): it must bear a second call."""
    before_end()
    await send({"type": "http.response.body", "body": sse_error(error) if error else b"", "more_body": False})

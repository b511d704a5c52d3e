"""Relaying a decode's answer to the client: raw ASGI sends, no buffering of streams.

The stream is not parsed. Two cheap checks decide how it ended: the transport (the decode's connection
closed or went silent before the end of the HTTP body) and the last bytes (an SSE body must end with
`data: [DONE]`). A stream that breaks gets one terminal SSE error event (`pd_decode_failed`), so a
client never mistakes a truncated answer for a complete one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdgate.router.errors import DecodeFailed, RouterError, UpstreamTimeout, sse_error
from pdgate.router.upstream import ReadTimeout, UpstreamError, UpstreamResponse

__all__ = ["SSE", "relay_stream", "send_body", "send_error"]

SSE = b"text/event-stream"
_TAIL = 32


async def send_body(
    send: Callable, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes, before_end: Callable[[], None]
) -> None:
    """One complete response (status, headers, body)."""
    hdrs = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    before_end()
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Callable, err: RouterError, extra: Sequence[tuple[bytes, bytes]], before_end: Callable[[], None]
) -> None:
    status = err.upstream_status if hasattr(err, "upstream_status") else err.status
    await send_body(send, status, [*err.headers(), *extra], err.body(), before_end)


async def relay_stream(
    send: Callable,
    resp: UpstreamResponse,
    first: bytes | None,
    headers: Sequence[tuple[bytes, bytes]],
    idle_timeout: float,
    before_end: Callable[[], None],
) -> RouterError | None:
    """Relay a 200 streaming answer whose first body bytes (`first`) were already read.

    Returns None when the stream ended as it should, else the error that was sent as the last event.
    """
    sse = (resp.header(b"content-type") or b"").startswith(SSE)
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    tail = b""
    error: RouterError | None = None
    chunk = first
    try:
        while chunk is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
            chunk = await resp.next_chunk(idle_timeout)
    except ReadTimeout as exc:
        error = UpstreamTimeout(f"decode stream stalled: {exc}")
    except UpstreamError as exc:
        error = DecodeFailed(f"decode stream broke: {exc}")
    if error is None and sse and not tail.rstrip().endswith(b"[DONE]"):
        error = DecodeFailed("decode stream ended without [DONE]")
    before_end()
    await send({"type": "http.response.body", "body": sse_error(error) if error else b"", "more_body": False})
    return error

"""One answering request to an engine, judged before a byte reaches the client: what a decode attempt and a
whole request (`whole`) share.

The answer is judged while another instance can still be tried:
- a status other than 2xx is read whole (the caller relays a 4xx, retries a failure);
- a JSON answer is read whole and must be a JSON object: an empty body, a connection that closes early
  or a body that does not parse is `pd_decode_failed`;
- a stream must be `text/event-stream`, and its first chunk must not be the engine's error event.
Any exception while connecting to, writing to or reading from the engine is translated by
`errors.UPSTREAM_FAILURES[side]`; the response is closed when the call raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import orjson
from pdgate.router.errors import UPSTREAM_FAILURES, DecodeFailed, Where, failed, translate
from pdgate.router.request_flow import MAX_ANSWER
from pdgate.router.retry import Verdict, verdict
from pdgate.router.stall import FirstByteClock
from pdgate.router.streaming import engine_error, is_sse
from prometheus_client import Histogram

from pdgate.upstream import Upstream, UpstreamResponse

__all__ = ["Answer", "check_json_answer", "open_answer"]


@dataclass
class Answer:
    """An engine's answer as judged: `data` is the whole body (JSON, or an error status) or the first
    chunk of a stream."""

    resp: UpstreamResponse
    verdict: str
    data: bytes | None


async def open_answer(
    upstream: Upstream,
    url: str,
    headers: Sequence[tuple[bytes, bytes]],
    payload: bytes,
    *,
    stream: bool,
    timeout: float,
    idle_timeout: float,
    where: Where,
    ttft: Histogram,
    first_byte: FirstByteClock | None = None,
) -> Answer:
    """Send `payload` and judge the answer (module doc); raises the engine's typed failure. `first_byte`:
    a stream's first chunk must come within its timeout (`stall`), and its latency is recorded there."""
    resp: UpstreamResponse | None = None
    queued = stream and first_byte is not None
    try:
        t = perf_counter()
        if queued:
            assert first_byte is not None
            timeout = min(timeout, first_byte.enter(where.internal))
        resp = await upstream.request("POST", url, list(headers), payload, timeout=timeout)
        v = verdict(resp.status)
        if v != Verdict.OK:
            return Answer(resp, v, await resp.read(timeout=timeout, limit=MAX_ANSWER))
        if stream:
            if not is_sse(resp.header(b"content-type")):
                ctype = (resp.header(b"content-type") or b"no content-type").decode("latin-1")
                raise failed(DecodeFailed, where, "answered a stream request with a body that is not SSE", ctype)
            data = await resp.next_chunk(timeout)
            if data is None:
                raise failed(DecodeFailed, where, "answered 200 with an empty stream")
            if b'"error"' in data and (found := engine_error(data)) is not None and found[0] == 0:
                raise failed(DecodeFailed, where, "failed the request before its first token", found[1])
            took = perf_counter() - t
            ttft.observe(took)
            if first_byte is not None:
                first_byte.observe(took)
            return Answer(resp, v, data)
        ttft.observe(perf_counter() - t)
        data = await resp.read(timeout=idle_timeout, limit=MAX_ANSWER)
        check_json_answer(data, where)
        return Answer(resp, v, data)
    except BaseException as exc:  # a cancellation too closes the connection; only failures are translated
        if resp is not None:
            resp.close()
        if not isinstance(exc, Exception):
            raise
        raise translate(exc, UPSTREAM_FAILURES["decode"], where) from exc
    finally:
        if queued:
            assert first_byte is not None
            first_byte.leave(where.internal)


def check_json_answer(data: bytes, where: Where) -> None:
    """A 200 JSON answer must be a whole JSON object: an empty or cut body is the engine's failure, and
    the client must never get it as a 200."""
    if not data:
        raise failed(DecodeFailed, where, "answered 200 with an empty body")
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise failed(DecodeFailed, where, "answered 200 with a body that is not JSON", str(exc)) from exc
    if not isinstance(parsed, dict):
        raise failed(DecodeFailed, where, "answered 200 with JSON that is not an object")

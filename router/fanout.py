"""A completion with several prompts: one prefill/decode pair per prompt, answers merged in order.

Why fan out: vLLM answers a multi-prompt request with the `kv_transfer_params` of its first prompt only,
so one prefill of all prompts would leave the decode to recompute every other prompt. Each prompt is
therefore its own PD request (its own handoff, prefill and decode, run concurrently), and the answers
are merged the way vLLM merges its own: choice `index` = prompt index * n + the choice's index, one
`id`, usage summed over the prompts.

Whole answers: the first prompt (in order) whose answer is not a 200 gives the client its error, and the
other prompts are cancelled (their handoffs aborted). Streams: nothing goes to the client until every
prompt's decode has answered 200 (an error before that is sent as the error answer, like one prompt's);
then the prompts' events are relayed as they come, each re-indexed and given the one id; each prompt's
final usage event is held and one summed usage event ends the stream, then a single `[DONE]`. An error
event from one prompt's stream is relayed, the other prompts are cancelled, and the stream ends.

Admission (`admit`) counts what a request costs the engines, not that it is one request: prompts x n
(vLLM runs n sequences per prompt). A request over `--max-fan-out` (or over `--max-inflight`, which it
could never fit) is refused with 400 `pd_unsupported_parameter` before any engine work; one that would
take the router past `--max-inflight` gets 429 `pd_overloaded`. Why: 256 prompts x n=128 was accepted
with 200 while the router's in-flight gauge read 1 and the prefill had 253 requests in flight; the
connect timeouts it caused opened the prefill's breaker, and every other client got "unavailable".
Everything but the prompt is encoded once for all the prompts (`bodies.SplicedBody.fan_out`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from pdgate.router.answers import split_events
from pdgate.router.errors import DecodeFailed, Overloaded, RouterError, UnsupportedByPD
from pdgate.router.request_flow import ProxiedRequest
from pdgate.router.streaming import send_body, send_error

from pdgate.asgi import Message, Send

__all__ = ["ServeOne", "admit", "fan_out", "merge_answers", "merge_usage"]

ServeOne = Callable[[ProxiedRequest, Send], Awaitable[str]]
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def admit(body: dict[str, Any], parts: Sequence[Any] | None, others: int, max_inflight: int, max_fan_out: int) -> int:
    """The engine requests one client request asks for (prompts x n), if it may start while `others`
    are in flight; else the typed refusal (see the module doc). Validation checked `n`'s type."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompts = len(parts) if parts else 1
    weight = prompts * n
    cap = min(max_fan_out, max_inflight)
    if weight > cap:
        raise UnsupportedByPD(
            f"this request asks for {prompts} prompt(s) x n={n} = {weight} engine requests; the router serves "
            f"at most {cap} per request (--max-fan-out): send fewer prompts or a smaller n",
            param="n" if n > 1 else "prompt",
        )
    if others + weight > max_inflight:
        raise Overloaded(f"{others} engine requests in flight; {weight} more would pass the limit of {max_inflight}")
    return weight


def merge_usage(usages: Sequence[Any]) -> dict[str, Any] | None:
    """The sum of several prompts' usage objects (None when none has one)."""
    found = [u for u in usages if isinstance(u, dict)]
    if not found:
        return None
    out = dict(found[0])
    for key in _USAGE_KEYS:
        out[key] = sum(u.get(key) or 0 for u in found)
    cached = [
        u["prompt_tokens_details"].get("cached_tokens")
        for u in found
        if isinstance(u.get("prompt_tokens_details"), dict)
    ]
    if cached:
        out["prompt_tokens_details"] = {
            **found[0].get("prompt_tokens_details", {}),
            "cached_tokens": sum(c or 0 for c in cached),
        }
    return out


def _reindex(choices: Any, prompt: int, n: int) -> None:
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            choice["index"] = prompt * n + (choice.get("index") or 0)


def merge_answers(answers: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """vLLM's answer to one request with these prompts, from one answer per prompt (in order)."""
    merged = dict(answers[0])
    choices: list[Any] = []
    for i, answer in enumerate(answers):
        part = answer.get("choices") or []
        _reindex(part, i, n)
        choices.extend(part)
    merged["choices"] = choices
    usage = merge_usage([a.get("usage") for a in answers])
    if usage is not None:
        merged["usage"] = usage
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None
    return merged


class _Captured:
    """One prompt's whole answer, as its decode sent it."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []

    async def __call__(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = [(k, v) for k, v in msg["headers"] if k != b"content-length"]
        elif msg["type"] == "http.response.body":
            self.parts.append(msg.get("body", b""))


async def _run(serve_one: ServeOne, child: ProxiedRequest, send: Send, abort: Callable[[ProxiedRequest], None]) -> str:
    try:
        return await serve_one(child, send)
    finally:
        child.finished = True
        abort(child)


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def fan_out(
    serve_one: ServeOne,
    children: Sequence[ProxiedRequest],
    send: Send,
    parent: ProxiedRequest,
    abort: Callable[[ProxiedRequest], None],
    n: int,
) -> str:
    """Serve every child (one prompt each) and answer the client once; returns the request's outcome."""
    if parent.facts.stream:
        return await _Streams(serve_one, children, send, parent, abort, n).run()
    caps = [_Captured() for _ in children]
    tasks: list[asyncio.Future[str]] = [
        asyncio.ensure_future(_run(serve_one, c, cap, abort)) for c, cap in zip(children, caps, strict=True)
    ]
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(caps[tasks.index(t)].status != 200 for t in done):
                break
        await _cancel(list(pending))
        outcomes = [t.result() if t.done() and not t.cancelled() else "cancelled" for t in tasks]
    except BaseException:
        await _cancel(tasks)
        raise
    rid = [(b"x-request-id", parent.rid)]
    for cap, outcome in zip(caps, outcomes, strict=True):
        if cap.status not in (0, 200):
            headers = [(k, v) for k, v in cap.headers if k != b"x-request-id"]
            await send_body(send, cap.status, [*headers, *rid], b"".join(cap.parts), parent.end)
            return outcome
    answers = [orjson.loads(b"".join(cap.parts)) for cap in caps]
    body = orjson.dumps(merge_answers(answers, n))
    parent.started = True
    await send_body(send, 200, [(b"content-type", b"application/json"), *rid], body, parent.end)
    return "ok"


class _Streams:
    """The merge of several prompts' SSE answers into one stream (see the module doc)."""

    def __init__(
        self,
        serve_one: ServeOne,
        children: Sequence[ProxiedRequest],
        send: Send,
        parent: ProxiedRequest,
        abort: Callable[[ProxiedRequest], None],
        n: int,
    ) -> None:
        self._serve_one = serve_one
        self._children = children
        self._send = send
        self._parent = parent
        self._abort = abort
        self._n = n
        self._queue: asyncio.Queue[tuple[int, Message | None]] = asyncio.Queue()
        k = len(children)
        self._starts: list[Message | None] = [None] * k
        self._held: list[list[Message]] = [[] for _ in range(k)]
        self._rest = [b""] * k
        self._usages: list[dict[str, Any]] = []
        self._id: Any = None
        self._error: str | None = None

    def _sender(self, i: int) -> Send:
        async def send(msg: Message) -> None:
            self._queue.put_nowait((i, msg))

        return send

    async def _child(self, i: int) -> str:
        try:
            return await _run(self._serve_one, self._children[i], self._sender(i), self._abort)
        finally:
            self._queue.put_nowait((i, None))

    async def run(self) -> str:
        tasks: list[asyncio.Future[str]] = [asyncio.ensure_future(self._child(i)) for i in range(len(self._children))]
        try:
            return await self._merge(tasks)
        finally:
            await _cancel(tasks)

    async def _merge(self, tasks: list[asyncio.Future[str]]) -> str:
        k = len(tasks)
        ended: set[int] = set()
        opened = False
        while len(ended) < k:
            i, msg = await self._queue.get()
            if msg is None:
                ended.add(i)
                if not opened and self._starts[i] is None:  # ended without a word (cancelled, or a bug)
                    await self._fail(tasks, DecodeFailed(f"prompt {i}: the request ended without an answer"))
                    return "decode_failed"
                continue
            if msg["type"] == "http.response.start":
                self._starts[i] = msg
            elif opened:
                if i not in ended and not self._error:
                    await self._relay(i, msg, tasks)
                continue
            else:
                self._held[i].append(msg)
            start = self._starts[i]
            if not opened and start is not None and start["status"] != 200:
                if self._held[i] and not self._held[i][-1].get("more_body", False):
                    await _cancel([t for j, t in enumerate(tasks) if j != i])
                    headers = [(a, b) for a, b in start["headers"] if a not in (b"content-length", b"x-request-id")]
                    body = b"".join(m.get("body", b"") for m in self._held[i])
                    await send_body(
                        self._send,
                        start["status"],
                        [*headers, (b"x-request-id", self._parent.rid)],
                        body,
                        self._parent.end,
                    )
                    return tasks[i].result() if tasks[i].done() and not tasks[i].cancelled() else "upstream_rejected"
                continue
            if not opened and all(s is not None and s["status"] == 200 for s in self._starts):
                opened = True
                first = self._starts[0]
                assert first is not None
                headers = [(a, b) for a, b in first["headers"] if a not in (b"content-length", b"x-request-id")]
                self._parent.started = True
                await self._send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [*headers, (b"x-request-id", self._parent.rid)],
                    }
                )
                for j in range(k):
                    for held in self._held[j]:
                        if not self._error:
                            await self._relay(j, held, tasks)
                    self._held[j] = []
        tail = b""
        if self._usages and not self._error:
            last = dict(self._usages[-1])
            last["usage"] = merge_usage([u.get("usage") for u in self._usages])
            last["id"] = self._id if self._id is not None else last.get("id")
            tail = b"data: " + orjson.dumps(last) + b"\n\n"
        self._parent.end()
        await self._send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        return self._error or "ok"

    async def _fail(self, tasks: list[asyncio.Future[str]], err: RouterError) -> None:
        await _cancel(tasks)
        await send_error(self._send, err, [(b"x-request-id", self._parent.rid)], self._parent.end)

    async def _relay(self, i: int, msg: Message, tasks: list[asyncio.Future[str]]) -> None:
        events, self._rest[i] = split_events(self._rest[i] + msg.get("body", b""))
        out: list[bytes] = []
        for ev in events.split(b"\n\n"):
            if not ev.startswith(b"data: {"):
                continue  # [DONE] (one ends the merged stream), blank lines, comments
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                out.append(ev + b"\n\n")
                continue
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                self._error = str(err.get("code") if isinstance(err, dict) else "") or "decode_failed"
                out.append(ev + b"\n\n")
                for j, t in enumerate(tasks):
                    if j != i:
                        t.cancel()
                break
            if self._id is None:
                self._id = obj.get("id")
            obj["id"] = self._id
            choices = obj.get("choices")
            if not choices and isinstance(obj.get("usage"), dict):
                self._usages.append(obj)  # a prompt's final usage: one summed event ends the stream
                continue
            _reindex(choices, i, self._n)
            out.append(b"data: " + orjson.dumps(obj) + b"\n\n")
        if out:
            await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": True})

"""What the prefill's answer adds to the client's: usage that tells the truth, and prompt logprobs; and
how an answer the router cannot use is told (`unusable`, `same_location`).

After a first token from the prefill (`pdgate.router.first_token`) the decode's counts are shifted by that
token, and its first event's prompt ids end with it: both are put back as the client's request has them.

Two things only the prefill's answer knows:
- how many prompt tokens' KV it computed and handed over (`kv_transfer_params.remote_num_tokens`, read
  through `KVTransferParams.parse` like every field of those params the router reads, else
  its `usage.prompt_tokens`). The decode's own `usage.prompt_tokens_details.cached_tokens` counts what
  it found in its local prefix cache (vLLM reports it only with --enable-prompt-tokens-details, and
  then as 0 for a transferred prompt), so cost accounting would bill every transferred prompt token as
  computed. The client's answer gets `usage.prompt_tokens_details.cached_tokens` = the larger of the
  two: prompt tokens the decode did not compute (OpenAI's field, which billing tools already read).
  Not when the decode recomputes the prompt anyway: vLLM turns `echo` with `logprobs` into prompt
  logprobs, for which it ignores any KV it did not compute (`decode_recomputes`).
- `prompt_logprobs`, which the decode is not asked for (`bodies.decode_body`): the prefill's are put
  where vLLM puts them (completions: each choice's `prompt_logprobs`; chat: the answer's).

The prefill's answer is the one the dispatcher already parsed for its `kv_transfer_params`
(`bodies.kv_params_from_prefill`, kept as `ProxiedRequest.prefill_answer`): read once, never re-parsed.

The client's answer is rewritten by `PatchingSend`, a `send` in front of the client's: a JSON answer is
parsed and re-encoded once (its content-length fixed), a stream is cut at event boundaries and only the
final usage event is re-encoded; every other byte passes as it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pdgate.router import first_token
from pdgate.router.errors import PrefillFailed
from pydantic import ValidationError

from pdgate.asgi import Message, Send
from pdgate.contract import InvalidTransferParams, KVTransferParams
from pdgate.models import KVLocation

__all__ = [
    "PatchingSend",
    "PrefillFacts",
    "decode_recomputes",
    "patch_answer",
    "patch_usage",
    "prefill_facts",
    "same_location",
    "split_events",
    "unusable",
]


@dataclass(frozen=True)
class PrefillFacts:
    """What the client's answer takes from the prefill's."""

    transferred: int | None  # prompt tokens whose KV the prefill computed and handed over
    prompt_logprobs: Any = None  # vLLM's prompt_logprobs list, when asked for
    first_token: bool = False  # the prefill's first token went out first: the decode counted it as prompt


def decode_recomputes(body: dict[str, Any], chat: bool) -> bool:
    """Whether the decode computes the whole prompt itself: a completion with `echo` and `logprobs`,
    which vLLM serves with prompt logprobs (and so skips every cached or transferred block)."""
    return not chat and bool(body.get("echo")) and body.get("logprobs") is not None


def prefill_facts(data: dict[str, Any] | None, chat: bool, kv: KVTransferParams | None = None) -> PrefillFacts:
    """What the prefill's answer (parsed by the dispatcher, `req.prefill_answer`) adds; None: nothing.
    `kv`: its `kv_transfer_params` as the dispatcher parsed them (`req.prefill_kv`); read through
    `KVTransferParams.parse` here when not given, so no field is read off the raw dict."""
    if data is None:
        return PrefillFacts(None)
    if kv is None:
        try:
            kv = KVTransferParams.parse(data.get("kv_transfer_params") or {})
        except InvalidTransferParams:
            kv = None
    usage = data.get("usage")
    n: Any = kv.remote_num_tokens if kv is not None else None
    if n is None and isinstance(usage, dict):
        n = usage.get("prompt_tokens")
    logprobs: Any = None
    if chat:
        logprobs = data.get("prompt_logprobs")
    else:
        choices = data.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            logprobs = choices[0].get("prompt_logprobs")
    return PrefillFacts(n if isinstance(n, int) and not isinstance(n, bool) else None, logprobs)


def patch_usage(usage: Any, facts: PrefillFacts) -> None:
    """Set `usage.prompt_tokens_details.cached_tokens` to the prompt tokens the decode did not compute; after
    a first token from the prefill (`first_token`), move that token from the prompt's count back to the
    completion's, where the client's request has it."""
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens")
    if facts.first_token and isinstance(prompt, int) and isinstance(usage.get("completion_tokens"), int):
        prompt = usage["prompt_tokens"] = prompt - 1
        usage["completion_tokens"] += 1
    if facts.transferred is None:
        return
    transferred = min(facts.transferred, prompt) if isinstance(prompt, int) else facts.transferred
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    own = details.get("cached_tokens")
    details["cached_tokens"] = max(own if isinstance(own, int) else 0, transferred)


def patch_answer(answer: dict[str, Any], facts: PrefillFacts, chat: bool) -> None:
    """A whole (non-stream) answer of the decode, as the client gets it."""
    patch_usage(answer.get("usage"), facts)
    if facts.prompt_logprobs is None:
        return
    if chat:
        answer["prompt_logprobs"] = facts.prompt_logprobs
        return
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict):
            choice["prompt_logprobs"] = facts.prompt_logprobs


def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """(complete SSE events, the incomplete rest) of a stream's bytes so far."""
    end = buf.rfind(b"\n\n")
    return (buf[: end + 2], buf[end + 2 :]) if end >= 0 else (b"", buf)


_PROMPT_IDS = b'"prompt_token_ids":['


def _patch_events(events: bytes, facts: PrefillFacts, prompt_ids: bool) -> tuple[bytes, bool]:
    """Re-encode the final usage event (no choices, a usage object) and, while `prompt_ids` (a decode after
    the prefill's first token, asked for `return_token_ids`), the first event that lists prompt ids, which
    the client already got; every other event as it came. Returns the events and whether prompt ids are
    still to be taken out."""
    if b'"usage":{' not in events and not (prompt_ids and _PROMPT_IDS in events):
        return events, prompt_ids
    out: list[bytes] = []
    for ev in events.split(b"\n\n"):
        if ev.startswith(b"data: {") and (b'"usage":{' in ev or (prompt_ids and _PROMPT_IDS in ev)):
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and not obj.get("choices") and isinstance(obj.get("usage"), dict):
                patch_usage(obj["usage"], facts)
                ev = b"data: " + orjson.dumps(obj)
            elif isinstance(obj, dict) and prompt_ids and isinstance(obj.get("choices"), list):
                for choice in obj["choices"]:
                    if isinstance(choice, dict) and choice.get("prompt_token_ids") is not None:
                        choice["prompt_token_ids"] = None
                        prompt_ids = False
                ev = b"data: " + orjson.dumps(obj)
        out.append(ev)
    return b"\n\n".join(out), prompt_ids


class PatchingSend:
    """The client's `send`, behind which a decode's 200 answer gets what the prefill's answer adds."""

    def __init__(
        self, send: Send, facts: PrefillFacts, chat: bool, *, drop_prompt_ids: bool = False, stream: bool = False
    ) -> None:
        """`stream`: the client's stream already started (the prefill's first token went out), so what
        comes is SSE even when no decode ever sends its status line (a stream resumed whole before the
        decode's first byte still gets its usage patched)."""
        self._send = send
        self._facts = facts
        self._chat = chat
        self._prompt_ids = drop_prompt_ids  # the decode's first prompt ids are still to be taken out
        self._start: Message | None = None
        self._stream = stream
        self._rest = b""

    async def __call__(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            if msg["status"] != 200:
                self._facts = PrefillFacts(None)  # an error passes untouched
                await self._send(msg)
                return
            ctype = next((v for k, v in msg["headers"] if k == b"content-type"), b"")
            self._stream = ctype.lower().startswith(b"text/event-stream")
            if self._stream:
                await self._send(msg)
            else:
                self._start = msg  # held until the body: its content-length changes
            return
        if msg["type"] != "http.response.body" or not self._patches():
            await self._flush_start(msg.get("body", b""))
            await self._send(msg)
            return
        if self._stream:
            events, self._rest = split_events(self._rest + msg.get("body", b""))
            more = msg.get("more_body", False)
            patched, self._prompt_ids = _patch_events(events, self._facts, self._prompt_ids)
            body = patched + (b"" if more else self._rest)
            if body or not more:
                await self._send({**msg, "body": body})
            return
        await self._whole(msg)

    def _patches(self) -> bool:
        f = self._facts
        return f.transferred is not None or f.prompt_logprobs is not None or f.first_token

    async def _whole(self, msg: Message) -> None:
        body = msg.get("body", b"")
        if self._start is not None:
            try:
                answer = orjson.loads(body)
            except orjson.JSONDecodeError:
                answer = None
            if isinstance(answer, dict):
                patch_answer(answer, self._facts, self._chat)
                body = orjson.dumps(answer)
        await self._flush_start(body)
        await self._send({**msg, "body": body})

    async def _flush_start(self, body: bytes) -> None:
        start, self._start = self._start, None
        if start is not None:
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await self._send({**start, "headers": headers})


def unusable(exc: Exception) -> tuple[str, str]:
    """(what the client reads, what the log adds) about a prefill answer the router cannot use: the
    router's own sentence, the field a parse refused, never the value the engine sent."""
    if isinstance(exc, first_token.BadFirstToken):
        return f"answered a first token the router refuses: {exc}", ""
    if isinstance(exc, InvalidTransferParams):
        field = exc.context.get("field")
        what = f"kv_transfer_params.{field} is invalid" if isinstance(field, str) else "kv_transfer_params are invalid"
        return f"answered with {what}", exc.message
    if isinstance(exc, PrefillFailed):  # `bodies.kv_params_from_prefill`: the router's own words
        return exc.message.removeprefix("prefill "), ""
    return "answered with something the router cannot use", f"{type(exc).__name__}: {exc}"


def same_location(hint: object, ledger: KVLocation | None) -> bool:
    """Whether the prefill's `remote_location` says what the ledger's record says (defaults filled in)."""
    try:
        return ledger is not None and KVLocation.model_validate(hint) == ledger
    except ValidationError:
        return False

"""Resuming a stream on another instance: what the client received, and the rest of its request (pure parts).

A stream the router may resume is asked of its engine with `return_token_ids` (the router sets it), so
every event names the token ids it carries. `StreamTrack` is the client's send behind such a stream: it
passes only whole SSE events (a partial event when the engine dies is never delivered), records the
prompt's ids and, per choice, the ids the client received and whether the choice finished, and takes
the ids out again when the client did not ask for them (as vLLM's stream has no such keys then).

When the engine dies, stalls or fails mid-stream, the rest of the request goes to another instance as a
completion (`continuation_body`): prompt = the prompt's ids + the ids generated so far, max_tokens = what
is left, every sampling field as the client sent it; with `n > 1` each unfinished choice goes on as its
own completion (n = 1), one after the other, keeping its index. A chat goes on as a completion on the chat template's
ids (vLLM returns them as the first event's `prompt_token_ids`) and its events are turned back into
chat chunks (`Continuation`). For greedy sampling the resumed stream is the one instance's stream token for
token. Differences, documented in router/README.md: a seeded sampler starts again from its seed at the
resume point (the tokens after it are another draw than one instance's); presence and frequency
penalties count only the tokens generated after the resume (the earlier ones are prompt now); a stop
string that would span the resume point is not seen; a completion's `logprobs.text_offset` restarts at
the resume point's text.

Every token of such a stream passes through `StreamTrack`, so its common case is kept cheap (issue #22):
a write of one whole event is neither split nor joined, an unchanged write goes on as it came, and a
stream's token events are matched against the bytes they share (`_Template`) instead of being parsed.
tests/unit/router/test_stream_track_fast.py checks all of it against the track without these paths.
"""

from __future__ import annotations

from collections.abc import Awaitable
from time import perf_counter
from typing import Any

import orjson
from pdgate.router.answers import split_events
from pdgate.router.streaming import Garbage

from pdgate.asgi import Message, Send

__all__ = ["Continuation", "StreamTrack", "continuation_body"]

_DONE = b"data: [DONE]"

# Chat fields that mean the same on the completion a chat goes on as.
_SAMPLING = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "user",
    "priority",
    "stream_options",
)


class StreamTrack:
    """The client's send behind a resumable stream (module doc). `budget` is the `max_tokens` the engine
    was asked for (None: unbounded); `asked_ids`: the client asked for `return_token_ids` itself."""

    def __init__(self, send: Send, *, chat: bool, asked_ids: bool, budget: int | None, n: int = 1) -> None:
        self._send = send
        self.n = n  # the choices the client asked for
        self.chat = chat
        self.asked_ids = asked_ids
        self.budget = budget
        self.prompt_ids: list[int] | None = None
        # Tokens of the answer the client got before this track's first event: the prefill's first token when
        # the decode went on after it (it ends `prompt_ids`). Only for saying where a stream resumed.
        self.given = 0
        self.generated: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.head: dict[str, Any] = {}  # id, created, model of the client's stream
        self.rest = b""  # an incomplete event, not delivered
        self._sse = True  # the answer is a stream (an error answer passes untouched)
        self._tpl: _Template | None = None  # the bytes this stream's token events share (`_Template`)
        self._learn = 3  # events a template may still be learned from (none fits a stream with logprobs)

    def can_resume(self) -> bool:
        """Whether the rest can be computed elsewhere: the router knows the prompt's ids."""
        return self.prompt_ids is not None

    def pending(self) -> list[int]:
        """The choices not finished yet, by index."""
        return [i for i in range(self.n) if i not in self.finished]

    def received(self) -> int:
        return sum(len(ids) for ids in self.generated.values())

    def __call__(self, msg: Message) -> Awaitable[None]:
        """The send (a plain function that returns what the next send returns: no coroutine of its own
        per token; Garbage is raised at the call)."""
        if msg["type"] != "http.response.body" or not self._sse:
            if msg["type"] == "http.response.start":
                self._sse = msg["status"] == 200 and any(
                    k == b"content-type" and v.startswith(b"text/event-stream") for k, v in msg["headers"]
                )
            return self._send(msg)
        body = msg.get("body", b"")
        if self.rest or not (body.endswith(b"\n\n") and 0 < body.find(b"\n") == len(body) - 2):
            return self._relay(msg)
        # One whole event of one line, as an engine writes each token: neither split nor joined, and the
        # write goes on as it came when the event is unchanged. (memchr for the first newline: a search
        # for the blank line costs several times more.) A Garbage event: nothing to send before it.
        ev = self._event(body[:-2])
        if ev is None:
            return self._send(msg)
        return self._send({**msg, "body": ev + b"\n\n", "more_body": msg.get("more_body", False)})

    async def _relay(self, msg: Message) -> None:
        """The general path: any number of events, an incomplete one kept back (`rest`). Events sent on
        as they came when none changed (no join), as when the engine's writes were read together."""
        events, self.rest = split_events(self.rest + msg.get("body", b""))
        more = msg.get("more_body", False)
        bad = None
        if events:
            parts = events.split(b"\n\n")
            same = not parts[-1]  # every event ends with its blank line (not so after a stray newline)
            if same:
                parts.pop()
            out = []
            for ev in parts:
                if not ev:  # an empty event: left out
                    same = False
                    continue
                try:
                    new = self._event(ev)
                except Garbage as exc:  # what came before it goes out; the rest is the engine's failure
                    bad, self.rest, same = str(exc), b"", False
                    break
                if new is not None:
                    ev, same = new, False
                out.append(ev)
            if not same:
                events = b"\n\n".join(out) + b"\n\n" if out else b""
        if events or (not more and bad is None):
            await self._send({**msg, "body": events, "more_body": more or bad is not None})
        if bad is not None:
            raise Garbage(bad)

    def _event(self, ev: bytes) -> bytes | None:
        """One whole event as the client gets it (no blank line); None: as it came."""
        if not ev.startswith(b"data: {"):
            if ev.startswith(b"data: ") and ev != _DONE:
                raise Garbage(ev[:64].decode("utf-8", "replace"))
            return None
        tpl = self._tpl
        if tpl is not None and (m := tpl.match(ev)) is not None:  # what `_one` would do, without a parse
            got = self.generated.setdefault(tpl.index, [])
            if m[1] is not None:
                got.extend(m[1])
            return None if tpl.out is None else tpl.out[0] + m[0] + tpl.out[1]
        try:
            obj = orjson.loads(ev[6:])
        except orjson.JSONDecodeError as exc:
            raise Garbage(ev[:64].decode("utf-8", "replace")) from exc
        if type(obj) is not dict:
            return None
        choices = obj.get("choices")
        if self.head and type(choices) is list and len(choices) == 1 and "prompt_token_ids" not in obj:
            if self._learn:
                self._learn -= 1
                self._tpl = _Template.learn(obj, ev, self.asked_ids) or self._tpl
            changed = self._one(choices[0])  # vLLM's event after the first (n = 1)
            if changed is not None:
                return b"data: " + orjson.dumps(obj) if changed else None
        return b"data: " + orjson.dumps(obj) if self._record(obj) else None

    def _one(self, c: Any) -> bool | None:
        """`_record` of an event whose only choice is `c` and that lists no prompt ids, the top level
        left as it is; None when `c` is not of that common shape (`_record` then takes the event)."""
        if type(c) is not dict or c.get("prompt_token_ids") is not None:
            return None
        index = c.get("index", 0)
        if type(index) is not int:
            return None
        tokens = c.get("token_ids")
        got = self.generated.setdefault(index, [])
        if type(tokens) is list:
            got.extend(tokens)
        if c.get("finish_reason") is not None:
            self.finished.add(index)
        if self.asked_ids or ("token_ids" not in c and "prompt_token_ids" not in c):
            return False
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)
        return True

    def _record(self, obj: dict[str, Any]) -> bool:
        """Record what the event carries; True when it was changed (ids taken out)."""
        changed = False
        if not self.head and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        ids = obj.get("prompt_token_ids")
        if "prompt_token_ids" in obj and not self.asked_ids:
            del obj["prompt_token_ids"]
            changed = True
        if isinstance(ids, list) and self.prompt_ids is None:
            self.prompt_ids = ids
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            index = c.get("index", 0)
            got = self.generated.setdefault(index if type(index) is int else 0, [])
            ids = c.get("prompt_token_ids")
            if isinstance(ids, list) and self.prompt_ids is None:
                self.prompt_ids = ids
            tokens = c.get("token_ids")
            if isinstance(tokens, list):
                got.extend(tokens)
            if c.get("finish_reason") is not None:
                self.finished.add(index)
            if not self.asked_ids:
                for key in ("prompt_token_ids", "token_ids"):
                    if key in c:
                        del c[key]
                        changed = True
        return changed


_TEXT, _IDS = "\x00text\x00", "\x00ids\x00"
_TEXT_JSON, _IDS_JSON = orjson.dumps(_TEXT)[1:-1], orjson.dumps(_IDS)


class _Template:
    """The bytes a stream's token events share, learned from one of them: `pre` TEXT `mid` IDS `post`
    (`mid` None: no ids), where TEXT is the choice's text (or chat delta's content) and IDS its
    `token_ids`, and `out` the same around TEXT with the ids taken out (None: the event goes out as it
    came). An event that is `pre` + a valid JSON string's inside + `mid` + one JSON list + `post` is
    valid JSON of exactly the learned shape, so what `_one` would record and send is known without a
    parse: the string is checked by parsing it alone, and where the event is re-encoded, its text must
    be what orjson writes (so the bytes equal `orjson.dumps` of the parsed event's)."""

    __slots__ = ("index", "mid", "out", "post", "pre")

    def __init__(self, index: int, parts: list[bytes], out: list[bytes] | None) -> None:
        self.index = index
        self.pre, self.post = parts[0], parts[-1]
        self.mid = parts[1] if len(parts) == 3 else None
        self.out = out

    @classmethod
    def learn(cls, obj: dict[str, Any], ev: bytes, asked: bool) -> _Template | None:
        """The template of `ev` (parsed: `obj`, one choice, no prompt ids at its top); None when its
        choice is not a plain token (finished, prompt ids, logprobs...) or its bytes are not orjson's."""
        c = obj["choices"][0]
        if type(c) is not dict or c.get("prompt_token_ids") is not None or c.get("finish_reason") is not None:
            return None
        index, delta, tokens = c.get("index", 0), c.get("delta"), c.get("token_ids", [])
        if type(index) is not int or type(tokens) is not list:
            return None
        t = dict(c)
        if type(c.get("text")) is str:
            t["text"] = _TEXT
        elif type(delta) is dict and len(delta) == 1 and type(delta.get("content")) is str:
            t["delta"] = {"content": _TEXT}
        else:
            return None
        if "token_ids" in c:
            t["token_ids"] = _IDS
        raw = b"data: " + orjson.dumps({**obj, "choices": [t]})
        pre, _, rest = raw.partition(_TEXT_JSON)
        parts = [pre, *rest.split(_IDS_JSON)]
        out = None
        if not asked and ("token_ids" in c or "prompt_token_ids" in c):
            t.pop("token_ids", None)
            t.pop("prompt_token_ids", None)
            out = (b"data: " + orjson.dumps({**obj, "choices": [t]})).split(_TEXT_JSON)
        if raw.count(_TEXT_JSON) != 1 or len(parts) != 2 + ("token_ids" in c) or (out and len(out) != 2):
            return None
        tpl = cls(index, parts, out)
        return tpl if tpl.match(ev) is not None else None

    def match(self, ev: bytes) -> tuple[bytes, list[Any] | None] | None:
        """(the text's bytes, the token ids) of an event of this shape; None for any other event."""
        pre, mid, post = self.pre, self.mid, self.post
        if not (ev.startswith(pre) and ev.endswith(post)) or len(ev) < len(pre) + len(post):
            return None
        tokens = None
        end = len(ev) - len(post)
        if mid is not None:
            k = ev.find(mid, len(pre))
            try:
                tokens = orjson.loads(ev[k + len(mid) : end]) if k >= 0 else None
            except orjson.JSONDecodeError:
                return None
            if type(tokens) is not list:
                return None
            end = k
        text = ev[len(pre) : end]
        quoted = b'"' + text + b'"'
        try:
            value = orjson.loads(quoted)
        except orjson.JSONDecodeError:
            return None
        if self.out is not None and b"\\" in text and orjson.dumps(value) != quoted:
            return None  # no escape in it: orjson writes the text as it is (a raw control character: no JSON)
        return text, tokens


def continuation_body(body: dict[str, Any], track: StreamTrack, index: int) -> dict[str, Any]:
    """The completion (n = 1) that computes the rest of choice `index` of `body` (module doc)."""
    assert track.prompt_ids is not None
    done = track.generated.get(index, [])
    if track.chat:
        out = {k: body[k] for k in _SAMPLING if k in body}
        if body.get("logprobs"):
            out["logprobs"] = body.get("top_logprobs") or 0
    else:
        out = {k: v for k, v in body.items() if k not in ("prompt", "suffix", "kv_transfer_params", "echo", "n")}
    out.update(prompt=[*track.prompt_ids, *done], stream=True, return_token_ids=True)
    out.pop("max_completion_tokens", None)
    if track.budget is not None:
        out["max_tokens"] = max(track.budget - len(done), 1)
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens:
        out["min_tokens"] = max(min_tokens - len(done), 0)
    return out


class Continuation:
    """The send a continuation's stream goes through on its way into the client's `StreamTrack`: its
    status line is not sent again, its events take the client's stream's id, creation time, model and
    choice index, its prompt ids are dropped (the client has them), a chat's completion events become
    chat chunks, and its usage counts the client's prompt and every token the client got. Of several
    choices resumed one after the other, only the `last` one's usage, `[DONE]` and end go out."""

    def __init__(self, track: StreamTrack, index: int, *, last: bool = True) -> None:
        self._track = track
        self._index = index
        self.last = last
        self._before = track.received()
        self._prompt = len(track.prompt_ids or ())
        self._rest = b""
        self.first_at: float | None = None  # when its first events came (the gap's end, for the log)

    async def __call__(self, msg: Message) -> None:
        if msg["type"] != "http.response.body":
            return
        events, self._rest = split_events(self._rest + msg.get("body", b""))
        if events:
            if self.first_at is None:
                self.first_at = perf_counter()
            events = b"".join(self._event(ev) for ev in events.split(b"\n\n") if ev)
        more = msg.get("more_body", False)
        if not self.last:  # the stream goes on with the next choice's continuation
            await self._track({**msg, "body": events, "more_body": True})
            return
        await self._track({**msg, "body": events + (b"" if more else self._rest)})

    def _event(self, ev: bytes) -> bytes:
        if not ev.startswith(b"data: {"):
            return ev + b"\n\n" if self.last else b""
        try:
            obj = orjson.loads(ev[6:])
        except orjson.JSONDecodeError:
            return ev + b"\n\n"
        if not isinstance(obj, dict):
            return ev + b"\n\n"
        obj.update(self._track.head)
        obj.pop("prompt_token_ids", None)
        usage = obj.get("usage")
        if usage is not None and not self.last:
            return b""
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage["prompt_tokens"] = self._prompt
            usage["completion_tokens"] += self._before
            usage["total_tokens"] = self._prompt + usage["completion_tokens"]
        choices = obj.get("choices")
        if isinstance(choices, list):
            obj["choices"] = [self._choice(c) for c in choices if isinstance(c, dict)]
        if self._track.chat:
            obj["object"] = "chat.completion.chunk"
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _choice(self, c: dict[str, Any]) -> dict[str, Any]:
        c.pop("prompt_token_ids", None)
        c["index"] = self._index
        if not self._track.chat:
            return c
        out: dict[str, Any] = {"index": self._index, "delta": {"content": c.get("text") or ""}}
        out["logprobs"] = _chat_logprobs(c.get("logprobs"))
        out["finish_reason"] = c.get("finish_reason")
        if "stop_reason" in c:
            out["stop_reason"] = c["stop_reason"]
        if "token_ids" in c:
            out["token_ids"] = c["token_ids"]
        return out


def _chat_logprobs(lp: Any) -> Any:
    """A completion chunk's logprobs ({tokens, token_logprobs, top_logprobs}) in a chat chunk's shape."""
    if not isinstance(lp, dict):
        return None
    tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    content = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append(
            {
                "token": tok,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(str(tok).encode()),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(str(t).encode())} for t, v in top.items()],
            }
        )
    return {"content": content}

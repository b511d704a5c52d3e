"""resume.StreamTrack's fast paths (a write of one whole one-line event: not split; a one-choice event:
not walked by `_record`; events unchanged: not joined) against the track without them (`General`): for
many generated streams the client gets the same bytes and the track records the same state. And what
both must do: the client never sees ids it did not ask for, and the track knows every id the client got."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from typing import Any

import orjson
import pytest
from pdgate.router.answers import split_events
from pdgate.router.resume import StreamTrack
from pdgate.router.streaming import Garbage

from pdgate.asgi import Message

TEXTS = [" tok", 'say "hi"', "back\\slash\\", '"token_ids":[1]', ',"token_ids":[2]}', "ünï©ødé ✓ 😀", "a,", "\n", ""]
SSE = [(b"content-type", b"text/event-stream")]


def choice(rng: random.Random, index: int, chat: bool, first: bool, last: bool) -> dict[str, Any]:
    text = rng.choice(TEXTS) + rng.choice(TEXTS)
    out: dict[str, Any] = {"index": index}
    if chat:
        out["delta"] = {"content": text}
        if rng.random() < 0.1:  # a tool call's delta has an index of its own
            out["delta"]["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
    else:
        out["text"] = text
    top = {"token_ids": -0.5, "index": -1.5, text: -2.0} if rng.random() < 0.2 else None
    out["logprobs"] = None if top is None else {"tokens": [text], "token_logprobs": [-0.1], "top_logprobs": [top]}
    out["finish_reason"] = "length" if last else None
    if rng.random() < 0.8:
        out["stop_reason"] = None
    if not chat:
        out["prompt_token_ids"] = [7, 8, 9] if first else None
    out["token_ids"] = [rng.randrange(100_000) for _ in range(rng.choice((1, 1, 1, 2, 0)))]
    if rng.random() < 0.03:
        out["token_ids"] = rng.choice((None, "5", [[5]], {"a": 5}))
    return out


def stream(rng: random.Random, chat: bool, n: int) -> list[bytes]:
    """A stream of events as vLLM writes them with `return_token_ids` (and some it never writes)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-1", "object": kind, "created": 1, "model": "m"}
    events = []
    steps = rng.randrange(1, 8)
    for step in range(steps):
        for i in rng.sample(range(n), n):
            obj: dict[str, Any] = {**head, "choices": [choice(rng, i, chat, step == 0, step == steps - 1)]}
            if chat and step == 0:
                obj["prompt_token_ids"] = [7, 8, 9]
            events.append(obj)
    if n == 2 and rng.random() < 0.3:  # two choices in one event
        events.append({**head, "choices": [choice(rng, 0, chat, False, True), choice(rng, 1, chat, False, True)]})
    if rng.random() < 0.5:
        usage = {"prompt_tokens": 3, "completion_tokens": steps, "total_tokens": 3 + steps}
        events.append({**head, "choices": [], "usage": usage})
    # Python's json escapes what orjson writes as it is (as an engine other than vLLM may)
    encode = orjson.dumps if rng.random() < 0.8 else (lambda e: json.dumps(e, separators=(",", ":")).encode())
    out = [b"data: " + encode(e) + b"\n\n" for e in events]
    odd = [b": keep-alive\n\n", b": ping\n\n\n", b"event: x\ndata: {}\n\n"]
    odd += [b"data: [1, 2]\n\n", b"data: {}\n\n", b"\n\n"]
    if rng.random() < 0.3:
        out.insert(rng.randrange(1, len(out) + 1), rng.choice(odd))
    out.append(b"data: [DONE]\n\n")
    if rng.random() < 0.1:  # the engine's garbage: the stream ends there
        out.insert(rng.randrange(1, len(out)), rng.choice([b"data: <html>\n\n", b'data: {"choices": [\n\n']))
    return out


def writes(rng: random.Random, events: list[bytes]) -> list[bytes]:
    """The events as an engine's writes: mostly one per write, some together, some cut anywhere."""
    if rng.random() < 0.4:
        return events
    if rng.random() < 0.5:  # whole events read together
        bounds = sorted({0, len(events), *(rng.randrange(1, len(events) + 1) for _ in range(3))})
        return [b"".join(events[a:b]) for a, b in itertools.pairwise(bounds)]
    data, cuts = b"".join(events), set()
    for _ in range(rng.randrange(1, 6)):
        cuts.add(rng.randrange(1, len(data)))
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


class General(StreamTrack):
    """The oracle: the track before its fast paths, written out here. Every write split into events and
    joined again, every event parsed and through `_record`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._learn = 0  # no template (`resume._Template`)

    async def __call__(self, msg: Message) -> None:
        if msg["type"] != "http.response.body" or not self._sse:
            await super().__call__(msg)
            return
        events, self.rest = split_events(self.rest + msg.get("body", b""))
        more, bad, out = msg.get("more_body", False), None, []
        for ev in events.split(b"\n\n") if events else ():
            if not ev:
                continue
            try:
                new = self._event(ev)
            except Garbage as exc:
                bad, self.rest = str(exc), b""
                break
            out.append((ev if new is None else new) + b"\n\n")
        events = b"".join(out)
        if events or (not more and bad is None):
            await self._send({**msg, "body": events, "more_body": more or bad is not None})
        if bad is not None:
            raise Garbage(bad)

    def _one(self, c: Any) -> bool | None:
        return None


def play(cls: type[StreamTrack], chunks: list[bytes], chat: bool, asked: bool, n: int) -> dict[str, Any]:
    sent: list[tuple[bytes, bool]] = []

    async def send(msg: Message) -> None:
        if msg["type"] == "http.response.body":
            sent.append((msg.get("body", b""), bool(msg.get("more_body"))))

    async def run() -> str | None:
        track = cls(send, chat=chat, asked_ids=asked, budget=64, n=n)
        await track({"type": "http.response.start", "status": 200, "headers": SSE})
        try:
            for i, chunk in enumerate(chunks):
                await track({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})
        except Garbage as exc:
            error = str(exc)
        else:
            error = None
        state = (track.prompt_ids, track.generated, track.finished, track.head, track.rest)
        return orjson.dumps([error, sent, *state], option=orjson.OPT_NON_STR_KEYS, default=sorted).decode()

    return {"out": asyncio.run(run()), "bytes": b"".join(b for b, _ in sent)}


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_delivers_and_records_what_the_general_path_does(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        chat, asked, n = rng.random() < 0.5, rng.random() < 0.3, rng.choice((1, 1, 2))
        chunks = writes(rng, stream(rng, chat, n))
        fast, general = play(StreamTrack, chunks, chat, asked, n), play(General, chunks, chat, asked, n)
        assert fast["out"] == general["out"], chunks


def test_the_client_gets_no_ids_it_did_not_ask_for_and_the_track_has_every_id_it_got() -> None:
    rng = random.Random(7)
    for _ in range(200):
        chat, n = rng.random() < 0.5, rng.choice((1, 2))
        garbage = (b"data: <", b"data: [1", b'data: {"choices": [')
        events = [e for e in stream(rng, chat, n) if not e.startswith(garbage)]
        sent = b""

        async def send(msg: Message, events: list[bytes] = events) -> None:
            nonlocal sent
            sent += msg.get("body", b"")

        track = StreamTrack(send, chat=chat, asked_ids=False, budget=None, n=n)

        async def run(track: StreamTrack = track, events: list[bytes] = events) -> None:
            await track({"type": "http.response.start", "status": 200, "headers": SSE})
            for ev in events:
                await track({"type": "http.response.body", "body": ev, "more_body": True})

        asyncio.run(run())
        expected: dict[int, list[int]] = {}
        for ev in events:
            obj = orjson.loads(ev[6:]) if ev.startswith(b"data: {") else {}
            for c in obj.get("choices", ()):
                ids = c["token_ids"]
                expected.setdefault(c["index"], []).extend(ids if isinstance(ids, list) else [])
        assert track.generated == expected and track.prompt_ids == [7, 8, 9]
        for ev in sent.split(b"\n\n"):
            obj = orjson.loads(ev[6:]) if ev.startswith(b"data: {") else {}
            assert "prompt_token_ids" not in obj
            assert all("token_ids" not in c and "prompt_token_ids" not in c for c in obj.get("choices", ()))


@pytest.mark.parametrize("cut", range(1, 24))
def test_a_write_that_ends_inside_an_event_is_kept_back_on_either_path(cut: int) -> None:
    data = b"event: x\ndata: {}\n\n" + b'data: {"id":"a","choices":[{"index":0,"token_ids":[5]}]}\n\n'
    chunks = [data[:cut], data[cut:]]
    fast, general = play(StreamTrack, chunks, False, False, 1), play(General, chunks, False, False, 1)
    assert fast["out"] == general["out"]
    assert fast["bytes"] == b'event: x\ndata: {}\n\ndata: {"id":"a","choices":[{"index":0}]}\n\n'


TOKEN = b'data: {"id":"a","choices":[{"index":0,"text":"x","token_ids":[5]}]}\n\n'
PLAIN = b'data: {"id":"a","choices":[{"index":0,"text":"x"}]}\n\n'  # an engine not asked for ids


@pytest.mark.parametrize(
    ("token", "bad"),
    [
        (PLAIN, b'data: {"id":"a","choices":[{"index":0,"text":"}]}\n\n'),  # the bytes around the text overlap
        (PLAIN, b'data: {"id":"a","choices":[{"index":0,"text":"x"y"}]}\n\n'),  # a quote not escaped
        (TOKEN, b'data: {"id":"a","choices":[{"index":0,"text":"x"y","token_ids":[5]}]}\n\n'),
        (TOKEN, b'data: {"id":"a","choices":[{"index":0,"text":"x\\","token_ids":[5]}]}\n\n'),  # quote escaped
        (TOKEN, b'data: {"id":"a","choices":[{"index":0,"text":"x","token_ids":[5]]}]}\n\n'),
        (TOKEN, b'data: {"id":"a","choices":[{"index":0,"text":"x","token_ids":[5],"token_ids":[6]}]}\n\n'),
    ],
)
@pytest.mark.parametrize("asked", [False, True])
def test_an_event_of_the_learned_shape_that_is_not_json_is_the_engines_failure(
    token: bytes, bad: bytes, asked: bool
) -> None:
    chunks = [token, token, token, bad, token]
    fast, general = play(StreamTrack, chunks, False, asked, 1), play(General, chunks, False, asked, 1)
    assert fast["out"] == general["out"]
    assert orjson.loads(fast["out"])[0] is not None or bad.count(b"token_ids") == 2  # Garbage, but a duplicate key

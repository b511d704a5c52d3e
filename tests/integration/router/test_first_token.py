"""The first token from the prefill (router/first_token.py), over real sockets: what the client gets, what
the decode is asked, and how failures after the first token end the stream.

Real parts: a `redis-server` as the ledger's store, two routers whose embedded metaservers share it (one
with `first_token_from_prefill`, one without: the classic path), `pdgate-sim` engines started with
`--token-ids` (a character tokenizer whose token ids travel as vLLM's do: sim/wire.py), and the official
`openai` client. The sims' answers are a function of the prompt text, and a token-id prompt whose last
ids are output tokens continues after them, so "the same text as the classic path" is an exact check:
a decode asked anything but the prefill's prompt ids plus the first token's id, or one token too many
or too few, answers other text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pdgate.metaserver.settings import MetaSettings
from pdgate.sim.wire import OUTPUT_ID_BASE

from pdgate.errors import Code
from tests.e2e.pdclient import metric
from tests.integration.router.conftest import HTTP, Deployment, Sim
from tests.support.ports import wait_until
from tests.support.redis import RedisServer

TOKEN = "first-token-admin-token"
TAKEN = "pdgate_router_first_token_from_prefill_total"
PROMPT = "The capital of France is"
MODEL = "sim-model"


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def _router(redis: RedisServer, **settings: Any) -> Deployment:
    meta = MetaSettings(store=redis.url, admin_token=TOKEN)
    return Deployment(
        meta_settings=meta,
        admin_token=TOKEN,
        prefill_policy="round_robin",
        decode_policy="round_robin",
        decode_timeout_s=5.0,
        breaker_failures=1000,  # a scripted failure must not take a decode out for the next test
        **settings,
    )


@pytest.fixture(scope="module")
def dep(redis: RedisServer) -> Iterator[Deployment]:
    """The router under test, and the sims (registered through it, into the shared store)."""
    with _router(redis) as d:
        d.add_many([("prefill", ("--token-ids",)), ("decode", ("--token-ids",)), ("decode", ("--token-ids",))])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(scope="module")
def classic(redis: RedisServer, dep: Deployment) -> Iterator[Deployment]:
    """A second router on the same store and sims, with the first token from the prefill off."""
    with _router(redis, first_token_from_prefill=False) as r:
        r.wait_available(*(s.id for s in dep.sims))
        yield r


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> None:
    dep.reset_sims()


def taken(dep: Deployment, value: bool) -> float:
    return metric(dep.url, TAKEN, {"taken": str(value).lower()})


def entries(dep: Deployment, mode: str) -> list[dict[str, Any]]:
    """Every request the sims of `dep` logged in `mode` (prefill / decode / plain), with its sim's id."""
    return [{**e, "sim": s.id} for s in dep.sims for e in s.stats(log=True)["log"] if e["mode"] == mode]


def stream(router: Deployment, **kw: Any) -> tuple[list[str], Any]:
    """The texts of a streamed completion's chunks, and its usage (None unless asked for)."""
    out = router.openai().completions.create(model=MODEL, stream=True, **kw)
    texts: list[str] = []
    usage = None
    for chunk in out:
        texts.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return texts, usage


def one_engine(sim: Sim, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """What one engine answers, asked directly (no PD), with its token ids."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    r = HTTP.post(sim.url + "/v1/completions", json=body)
    r.raise_for_status()
    return dict(r.json()["choices"][0])


def sse_events(router: Deployment, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """A streamed request's status and its SSE events, parsed (`[DONE]` kept as the string)."""
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as r:
        raw = r.read()
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return r.status_code, events


def test_the_sims_tokenizer_continues_after_output_ids_at_the_end_of_a_prompt(dep: Deployment) -> None:
    """The oracle the other tests rely on: one engine's ids for a prompt, and its continuation."""
    sim = dep.by_role("decode")[0]
    whole = one_engine(sim, PROMPT, 6)
    assert whole["prompt_token_ids"] == [ord(c) for c in PROMPT]
    assert len(whole["token_ids"]) == 6 and all(t >= OUTPUT_ID_BASE for t in whole["token_ids"])
    rest = one_engine(sim, [*whole["prompt_token_ids"], *whole["token_ids"][:2]], 4)
    assert rest["token_ids"] == whole["token_ids"][2:]
    assert one_engine(sim, PROMPT, 2)["text"] + rest["text"] == whole["text"]


@pytest.mark.parametrize("as_ids", [False, True], ids=["text prompt", "token-id prompt"])
def test_a_streamed_completion_gets_the_prefills_first_token_and_the_classic_text(
    dep: Deployment, classic: Deployment, as_ids: bool
) -> None:
    prompt: str | list[int] = [ord(c) for c in PROMPT] if as_ids else PROMPT
    before = taken(dep, True)
    texts, _ = stream(dep, prompt=prompt, max_tokens=6)
    assert taken(dep, True) == before + 1
    whole = one_engine(dep.by_role("decode")[0], PROMPT, 6)
    assert "".join(texts) == whole["text"] == "".join(stream(classic, prompt=prompt, max_tokens=6)[0])
    assert len(texts) == 6 and texts[0] == one_engine(dep.by_role("decode")[0], PROMPT, 1)["text"]  # its own chunk

    [pre] = [e for e in entries(dep, "prefill") if e["body"].get("return_token_ids")]
    assert pre["body"]["max_tokens"] == 1 and pre["prompt_token_ids"] == [ord(c) for c in PROMPT]
    [dec] = [e for e in entries(dep, "decode") if e["transfer_id"] == pre["transfer_id"]]
    assert dec["prompt_token_ids"] == [*pre["prompt_token_ids"], whole["token_ids"][0]]
    assert dec["body"]["max_tokens"] == 5 and dec["status"] == 200
    # the classic router's decode got the client's prompt and max_tokens
    [cdec] = [e for e in entries(dep, "decode") if e["transfer_id"] != pre["transfer_id"]]
    assert cdec["prompt_token_ids"] == [ord(c) for c in PROMPT] and cdec["body"]["max_tokens"] == 6


def test_usage_counts_the_first_token_as_the_clients_output(dep: Deployment, classic: Deployment) -> None:
    opts = {"include_usage": True}
    texts, usage = stream(dep, prompt=PROMPT, max_tokens=5, stream_options=opts)
    classic_texts, classic_usage = stream(classic, prompt=PROMPT, max_tokens=5, stream_options=opts)
    assert "".join(texts) == "".join(classic_texts)
    assert usage.prompt_tokens == classic_usage.prompt_tokens == len(PROMPT)
    assert usage.completion_tokens == classic_usage.completion_tokens == 5
    assert usage.total_tokens == classic_usage.total_tokens
    [dec] = [e for e in entries(dep, "decode") if len(e["prompt_token_ids"]) == len(PROMPT) + 1]
    assert usage.prompt_tokens == len(dec["prompt_token_ids"]) - 1  # the decode counted the first token in
    assert usage.completion_tokens == dec["body"]["max_tokens"] + 1


def chat_text(router: Deployment) -> str:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    out = router.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def test_return_token_ids_gives_the_classic_paths_ids(dep: Deployment, classic: Deployment) -> None:
    """The prompt's ids once, in the first event (as vLLM's stream has them), then one id per token: the
    decode's own prompt ids, which end with the first token, never reach the client."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, "return_token_ids": True}
    before = taken(dep, True)
    answers = [sse_events(router, body) for router in (dep, classic)]
    assert taken(dep, True) == before + 1
    for status, events in answers:
        assert status == 200 and events[-1] == "[DONE]"
    fast, slow = ([e["choices"][0] for e in events[:-1]] for _, events in answers)
    assert [c["prompt_token_ids"] for c in fast] == [c["prompt_token_ids"] for c in slow]
    assert fast[0]["prompt_token_ids"] == [ord(c) for c in PROMPT]
    assert [c["token_ids"] for c in fast] == [c["token_ids"] for c in slow]
    assert "".join(c["text"] for c in fast) == "".join(c["text"] for c in slow)
    [dec] = [e for e in entries(dep, "decode") if len(e["prompt_token_ids"]) == len(PROMPT) + 1]
    assert dec["prompt_token_ids"][-1] == fast[0]["token_ids"][0]


async def test_concurrent_streams_each_get_their_own_classic_text(dep: Deployment) -> None:
    """Many first tokens in flight at once: each client's stream is its own prompt's, whole."""
    prompts = [f"{PROMPT} #{i}" for i in range(24)]
    want = [one_engine(dep.by_role("decode")[0], p, 5)["text"] for p in prompts]
    before = taken(dep, True)
    client = dep.async_openai()

    async def one(p: str) -> str:
        out = await client.completions.create(model=MODEL, prompt=p, max_tokens=5, stream=True)
        return "".join([c.choices[0].text async for c in out if c.choices])

    assert await asyncio.gather(*(one(p) for p in prompts)) == want
    assert taken(dep, True) == before + len(prompts)
    for e, p in zip(decodes_by_prompt(dep, prompts), prompts, strict=True):
        assert len(e["prompt_token_ids"]) == len(p) + 1 and e["body"]["max_tokens"] == 4  # after the first token


def decodes_by_prompt(dep: Deployment, prompts: list[str]) -> list[dict[str, Any]]:
    """The decode request of each prompt (its token ids are the prompt's, and perhaps the first token's)."""
    logged = [(e, [t for t in e["prompt_token_ids"] if t < OUTPUT_ID_BASE]) for e in entries(dep, "decode")]
    return [next(e for e, ids in logged if ids == [ord(c) for c in p]) for p in prompts]


@pytest.mark.parametrize(
    "kind",
    ["stop", "not streamed", "max_tokens 1", "seed with sampling", "two prompts", "chat"],
)
def test_requests_that_read_the_output_keep_the_classic_path(dep: Deployment, classic: Deployment, kind: str) -> None:
    before = (taken(dep, True), taken(dep, False))
    if kind == "chat":
        assert chat_text(dep) == chat_text(classic)
        assert not any("prompt_token_ids" in e for e in entries(dep, "decode"))  # a chat's decode got messages
    elif kind == "two prompts":  # each is a PD pair of its own, whose events the router merges
        prompts = [PROMPT, PROMPT + "?"]
        out = dep.openai().completions.create(model=MODEL, prompt=prompts, max_tokens=4, stream=True)
        texts = ["", ""]
        for chunk in out:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [one_engine(dep.by_role("decode")[0], p, 4)["text"] for p in prompts]
        for e, p in zip(decodes_by_prompt(dep, prompts), prompts, strict=True):
            assert e["prompt_token_ids"] == [ord(c) for c in p] and e["body"]["max_tokens"] == 4
    else:
        kw: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4}
        if kind == "stop":
            kw["stop"] = ["zzz"]  # never in the sim's vocabulary: the text is still the whole answer
        elif kind == "max_tokens 1":
            kw["max_tokens"] = 1
        elif kind == "seed with sampling":
            kw.update(seed=7, temperature=0.8)
        if kind == "not streamed":
            text = dep.openai().completions.create(model=MODEL, **kw).choices[0].text
        else:
            text = "".join(stream(dep, **kw)[0])
        assert text == one_engine(dep.by_role("decode")[0], PROMPT, kw["max_tokens"])["text"]
        [dec] = entries(dep, "decode")
        assert dec["prompt_token_ids"] == [ord(c) for c in PROMPT] and dec["body"]["max_tokens"] == kw["max_tokens"]
    assert (taken(dep, True), taken(dep, False)) == before  # not even asked: the prefill gave no ids
    assert not any(e["body"].get("return_token_ids") for e in entries(dep, "prefill"))


def test_a_decode_failing_before_its_first_byte_is_retried_after_the_first_token(
    dep: Deployment, classic: Deployment
) -> None:
    bad, good = dep.by_role("decode")
    bad.script(fail_first=100, fail_status=503)
    before = taken(dep, True)
    prompts = [f"{PROMPT} {i}" for i in range(2)]  # round robin: one of the two starts on the failing decode
    for p in prompts:
        assert "".join(stream(dep, prompt=p, max_tokens=6)[0]) == one_engine(good, p, 6)["text"]
    assert taken(dep, True) == before + 2
    failed = [e for e in entries(dep, "decode") if e["sim"] == bad.id]
    assert failed and all(e["status"] == 503 for e in failed)
    for f in failed:
        [retried] = [e for e in entries(dep, "decode") if e["sim"] == good.id and e["transfer_id"] == f["transfer_id"]]
        assert retried["status"] == 200
        assert retried["prompt_token_ids"] == f["prompt_token_ids"]  # the same continuation, asked again
        assert retried["body"]["max_tokens"] == f["body"]["max_tokens"] == 5
    assert sum(p.count("prefill") for p in dep.by_role("prefill")) == 2  # no second prefill


def test_every_decode_failing_after_the_first_token_resumes_the_rest_on_another_instance(dep: Deployment) -> None:
    """Issue #24: the prefill's first token went out and then every decode fails before its first byte: the
    rest of the request goes whole to an instance that is left (here the prefill), and the client reads the
    one instance's answer with no error; before, the stream ended with pd_decode_failed."""
    whole = one_engine(dep.by_role("decode")[0], PROMPT, 6)["text"]  # asked before any fault is scripted
    for d in dep.by_role("decode"):
        d.script(fail_first=100, fail_status=503)
    status, events = sse_events(dep, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == whole
    assert all(e["id"] == events[0]["id"] for e in events[:-1])  # one stream, one id
    assert [d.count("scripted_failures") for d in dep.by_role("decode")] == [1, 1]  # a retry goes elsewhere
    [plain] = [e for e in entries(dep, "plain") if e["sim"] == dep.by_role("prefill")[0].id]
    assert plain["body"]["max_tokens"] == 5 and len(plain["prompt_token_ids"]) == len(PROMPT) + 1
    assert plain["prompt_token_ids"][: len(PROMPT)] == [ord(c) for c in PROMPT]  # + the first token's id


def test_a_decode_refusing_the_continuation_ends_the_stream_with_the_engines_reason(dep: Deployment) -> None:
    """A 4xx from the decode after the first token (the router could not know the model's length, say) is
    the engine's own refusal, relayed as the stream's typed error with the engine's message."""
    first = one_engine(dep.by_role("decode")[0], PROMPT, 1)["text"]
    for d in dep.by_role("decode"):
        d.script(fail_first=1, fail_status=400)
    status, events = sse_events(dep, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True})
    assert status == 200 and len(events) == 3, events
    assert events[0]["choices"][0]["text"] == first
    err = events[1]["error"]
    assert err["code"] == Code.UPSTREAM_REJECTED.value
    assert err["message"].startswith("scripted failure"), err  # the engine's own words
    assert events[2] == "[DONE]"
    assert sum(d.count("scripted_failures") for d in dep.by_role("decode")) == 1  # the client's error: no retry


@pytest.mark.parametrize("after", [0, 2])
def test_a_decode_dying_mid_stream_is_resumed_elsewhere(dep: Deployment, after: int) -> None:
    """Issue #24: every decode dies after `after` tokens of any stream; the stream is resumed on another
    instance each time (at most --max-resumes, 2: the second lands on the prefill), and the client reads
    the one instance's whole answer, without an error; before, the stream ended with pd_decode_failed."""
    want = one_engine(dep.by_role("decode")[0], PROMPT, 6)["text"]  # asked before any fault is scripted
    for d in dep.by_role("decode"):
        d.script(die_after_tokens=after)
    status, events = sse_events(dep, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    # after 0 the second decode finds the KV the first one took (a retry, not a death); after 2 each dies once
    assert sum(d.count("died") for d in dep.by_role("decode")) == (1 if after == 0 else 2)


def test_a_client_leaving_after_the_first_token_cancels_the_decode_and_aborts_the_handoff(dep: Deployment) -> None:
    first = one_engine(dep.by_role("decode")[0], PROMPT, 1)["text"]  # asked before any fault is scripted
    for d in dep.by_role("decode"):
        d.script(hang=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True}
    with httpx.stream("POST", dep.url + "/v1/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator would close the connection now
        line = next(lines)
        assert orjson.loads(line[6:])["choices"][0]["text"] == first
        wait_until(lambda: len(entries(dep, "decode")) == 1, what="the decode asked")
        [tid] = [e["transfer_id"] for e in entries(dep, "decode")]
        assert handoff_state(dep, tid) == "CLAIMED"  # by the router, for the decode it picked
    # leaving the block closed the connection with the answer unread
    wait_until(lambda: handoff_state(dep, tid) == "ABORTED", what="handoff aborted after the disconnect")
    wait_until(lambda: sum(d.count("cancelled") for d in dep.by_role("decode")) == 1, what="decode cancelled")


def handoff_state(dep: Deployment, tid: str) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    return str(HTTP.get(f"{dep.url}/v1/handoffs/{tid}", headers=auth).json()["state"])


def test_a_prefill_without_token_ids_keeps_the_classic_path_and_counts_it_not_taken() -> None:
    """An engine that does not answer `return_token_ids` (the sims without `--token-ids`): the prefill was
    asked, its answer has no ids, so the decode sends every token."""
    with Deployment() as d:
        d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(*(s.id for s in d.sims))
        texts, usage = stream(d, prompt=PROMPT, max_tokens=4, stream_options={"include_usage": True})
        assert len(texts) == 4 and usage.completion_tokens == 4
        assert (taken(d, True), taken(d, False)) == (0, 1)
        [pre] = entries(d, "prefill")
        [dec] = entries(d, "decode")
        assert pre["body"]["return_token_ids"] is True and dec["body"]["max_tokens"] == 4

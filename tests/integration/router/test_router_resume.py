"""A stream whose engine dies, stalls or fails after its first byte is resumed on another instance
(router/resume.py, router/whole.py), over real sockets with the openai client (issue #24).

Real parts: a router (embedded metaserver), one prefill and two decodes of `pdgate-sim --token-ids`. The
sims' answers are a function of the prompt, and a token-id prompt whose last ids are output tokens goes on
after them (sim/wire.py), so "the client reads one engine's greedy answer" is an exact check that the
rest was asked with the right ids and the right number of tokens left. The faults are the sims' scripts:
`die_after_tokens` (the connection drops after N tokens of every stream the sim serves) and `token_delay`
(a stall past the router's --stream-idle-timeout-s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from pdgate.sim.wire import OUTPUT_ID_BASE

from tests.e2e.pdclient import metric
from tests.integration.router.conftest import HTTP, Deployment, Sim

MODEL = "sim-model"
PROMPT = "A stream that breaks goes on elsewhere"
RESUMES = "pdgate_router_resumes_total"


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    with Deployment(decode_policy="round_robin", stream_idle_timeout_s=1.0, breaker_failures=1000) as d:
        d.add_many([("prefill", ("--token-ids",)), ("decode", ("--token-ids",)), ("decode", ("--token-ids",))])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> None:
    dep.reset_sims()


def one_engine(sim: Sim, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = HTTP.post(sim.url + path, json={**body, "stream": False, "return_token_ids": True})
    r.raise_for_status()
    return dict(r.json())


def raw_events(dep: Deployment, body: dict[str, Any], chat: bool = False) -> list[Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", dep.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read()
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            out.append("[DONE]" if block[6:] == b"[DONE]" else orjson.loads(block[6:]))
    return out


def resumes(dep: Deployment, **labels: str) -> float:
    try:
        return metric(dep.url, RESUMES, labels)
    except AssertionError:
        return 0.0


def die(dep: Deployment, after: int) -> None:
    for d in dep.by_role("decode"):
        d.script(die_after_tokens=after)


def test_a_greedy_stream_broken_twice_is_the_one_engines_answer(dep: Deployment) -> None:
    """Both decodes die 3 tokens into any stream: the first token comes from the prefill, 3 from the first
    decode, 3 from the second (the first resume), the rest from the prefill (the second): the openai client
    reads the one engine's 12 tokens, with no error, and usage counts what it received."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]["text"]
    die(dep, 3)
    before = resumes(dep)
    stream = dep.openai().completions.create(**body, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == len(PROMPT)
    assert len({c.id for c in chunks}) == 1
    assert resumes(dep) == before + 2
    assert sum(d.count("died") for d in dep.by_role("decode")) == 2
    log = dep.by_role("prefill")[0].stats(log=True)["log"]
    [cont] = [e for e in log if e["mode"] == "plain" and len(e["prompt_token_ids"]) > len(PROMPT)]
    assert cont["body"]["max_tokens"] == 12 - 7 and len(cont["prompt_token_ids"]) == len(PROMPT) + 7


def test_token_ids_reach_the_client_only_when_it_asked(dep: Deployment) -> None:
    """The router asks the engines for token ids to know what the client got; a client that did not ask
    never sees them, one that did sees the one engine's ids, the prompt's once."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]
    die(dep, 2)
    plain = raw_events(dep, body)
    assert plain[-1] == "[DONE]" and not any("error" in e for e in plain[:-1])
    for e in plain[:-1]:
        assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None for c in e["choices"]), e
    dep.reset_sims()
    die(dep, 2)
    asked = raw_events(dep, {**body, "return_token_ids": True})
    choices = [c for e in asked[:-1] for c in e["choices"]]
    assert [t for c in choices for t in c.get("token_ids") or []] == want["token_ids"]
    assert [c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids")] == [want["prompt_token_ids"]]
    assert all(t >= OUTPUT_ID_BASE for t in want["token_ids"])


def test_a_chat_stream_is_resumed_as_chat_chunks(dep: Deployment) -> None:
    """A chat goes on as a completion on the template's ids; the client reads chat chunks with the one
    engine's content."""
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10}
    want = one_engine(dep.by_role("prefill")[0], body, chat=True)["choices"][0]["message"]["content"]
    die(dep, 3)
    before = resumes(dep)
    chunks = list(dep.openai().chat.completions.create(**body, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert resumes(dep) > before


def test_a_stalled_stream_is_left_behind(dep: Deployment) -> None:
    """Both decodes stall between tokens past --stream-idle-timeout-s (1 s): each is left behind and the rest
    is computed elsewhere; the client gets every token, late."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]["text"]
    for d in dep.by_role("decode"):
        d.script(token_delay=30.0)
    before = resumes(dep, reason="pd_upstream_timeout")
    chunks = list(dep.openai().completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert resumes(dep, reason="pd_upstream_timeout") >= before + 1


def test_max_resumes_0_ends_the_stream_with_the_typed_error(dep: Deployment) -> None:
    """--max-resumes 0: the stream ends with pd_decode_failed, as before; the tokens that came are right."""
    prefill = [s.url for s in dep.by_role("prefill")]
    decode = [s.url for s in dep.by_role("decode")]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]["text"]
    with Deployment(prefill=prefill, decode=decode, max_resumes=0) as r:
        r.wait_available(*(s.id for s in dep.sims))
        die(dep, 2)
        events = raw_events(r, body)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "pd_decode_failed"
    got = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    assert got and want.startswith(got) and got != want


def test_a_decode_that_does_not_start_streaming_is_left_behind_early() -> None:
    """Issue #24 item 4: after the decodes' first chunks came within milliseconds many times, a decode that
    says nothing (decode_delay 30 s: no status line) is re-sent to the other decode once
    max(--first-byte-floor-s 0.5, 4 x their p99) passed, not after --decode-timeout-s (30 s here)."""
    with Deployment(decode_policy="round_robin", decode_timeout_s=30.0, first_byte_floor_s=0.5) as d:
        d.add_many([("prefill", ("--token-ids",)), ("decode", ("--token-ids",)), ("decode", ("--token-ids",))])
        d.wait_available(*(s.id for s in d.sims))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        client = d.openai()
        for _ in range(40):  # the spread of first chunks the router learns (MIN_SAMPLES = 32)
            list(client.completions.create(**body, stream=True))
        want = one_engine(d.by_role("prefill")[0], body)["choices"][0]["text"]
        slow, fast = d.by_role("decode")
        slow.script(decode_delay=30.0)
        for _ in range(2):  # round robin: one of the two goes to the slow decode first
            t = time.monotonic()
            chunks = list(client.completions.create(**body, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
            assert time.monotonic() - t < 10.0  # the bound this test is about: far under the 30 s timeout
        assert slow.count("decode") >= 1 and fast.count("decode") >= 2


def test_n_choices_are_each_resumed(dep: Deployment) -> None:
    """n = 3 (sampled: the sims' choices are one sequence): each unfinished choice goes on as its own
    completion, its events keep its index, and usage counts every token of every choice."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 1.0}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]["text"]
    die(dep, 3)
    before = resumes(dep)
    chunks = list(dep.openai().completions.create(**body, stream=True, stream_options={"include_usage": True}))
    texts = {i: "".join(c.text for k in chunks for c in k.choices if c.index == i) for i in range(3)}
    assert texts == {0: want, 1: want, 2: want}
    finishes = [c.finish_reason for k in chunks for c in k.choices if c.finish_reason]
    assert finishes == ["length"] * 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 * 8
    assert resumes(dep) > before


def test_a_stop_string_after_the_resume_point_ends_the_answer_as_one_engine(dep: Deployment) -> None:
    """`stop` goes with the rest: a stop string that the tokens after the resume point hold ends the
    resumed stream where one engine's ends, with its finish and stop reasons."""
    tokens = one_engine(dep.by_role("prefill")[0], {"model": MODEL, "prompt": PROMPT, "max_tokens": 16})
    words = [w.strip() for w in tokens["choices"][0]["text"].split(" ") if w.strip()]
    word = next(w for i, w in enumerate(words) if i >= 6 and not any(w in v for v in words[:i]))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "stop": [word]}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]
    assert want["finish_reason"] == "stop"
    die(dep, 3)
    chunks = list(dep.openai().completions.create(**body, stream=True))
    assert "".join(c.text for k in chunks for c in k.choices) == want["text"]
    last = [c for k in chunks for c in k.choices if c.finish_reason][-1]
    assert last.finish_reason == "stop" and getattr(last, "stop_reason", None) == word
    assert sum(d.count("died") for d in dep.by_role("decode")) >= 1


def test_logprobs_go_on_after_the_resume(dep: Deployment) -> None:
    """A completion's logprobs (tokens and values) and a chat's (as chat logprobs, converted from the
    completion the chat goes on as) equal one engine's."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "logprobs": 1}
    want = one_engine(dep.by_role("prefill")[0], body)["choices"][0]["logprobs"]
    die(dep, 3)
    before = resumes(dep)
    chunks = list(dep.openai().completions.create(**body, stream=True))
    got = [c.logprobs for k in chunks for c in k.choices if c.logprobs is not None]
    assert [t for lp in got for t in lp.tokens or []] == want["tokens"]
    assert [v for lp in got for v in lp.token_logprobs or []] == want["token_logprobs"]
    assert resumes(dep) > before

    dep.reset_sims()
    messages = [{"role": "user", "content": PROMPT}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 1}
    chat_want = one_engine(dep.by_role("prefill")[0], chat, chat=True)["choices"][0]["logprobs"]["content"]
    die(dep, 3)
    before = resumes(dep)
    stream = dep.openai().chat.completions.create(**chat, stream=True)  # type: ignore[call-overload]
    content = [e for k in stream for c in k.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in content] == [(e["token"], e["logprob"]) for e in chat_want]
    assert [[t.token for t in e.top_logprobs] for e in content] == [
        [t["token"] for t in e["top_logprobs"]] for e in chat_want
    ]
    assert resumes(dep) > before


def test_a_stream_resumed_after_the_prefills_first_token_counts_that_token_as_output() -> None:
    """The goodput burst's bug: the first token came from the prefill, the only decode then said nothing
    past the first-byte bound, and the stream went on whole; the answer was right but its usage counted the
    first token as prompt (completion_tokens one short: 217 of 256 requests read as cut)."""
    with Deployment(decode_timeout_s=30.0, first_byte_floor_s=0.5) as d:
        d.add_many([("prefill", ("--token-ids",)), ("decode", ("--token-ids",))])
        d.wait_available(*(s.id for s in d.sims))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        client = d.openai()
        for _ in range(40):  # the spread of first chunks the router learns (MIN_SAMPLES = 32)
            list(client.completions.create(**body, stream=True))
        want = one_engine(d.by_role("prefill")[0], body)
        taken = metric(d.url, "pdgate_router_first_token_from_prefill_total", {"taken": "true"})
        d.by_role("decode")[0].script(decode_delay=30.0)
        before = resumes(d)
        chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["choices"][0]["text"]
        assert metric(d.url, "pdgate_router_first_token_from_prefill_total", {"taken": "true"}) == taken + 1
        assert resumes(d) == before + 1
        usage = chunks[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (want["usage"]["prompt_tokens"], 6)

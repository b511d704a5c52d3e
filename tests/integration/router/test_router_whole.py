"""Whole requests (router/whole.py), over real sockets with the openai client: a request that PD cannot serve
now goes end to end to one instance, and its answer is the one instance's answer (issues #22 item 2, #24).

Real parts: `pdgate-sim` engines with `--token-ids` (answers are a function of the prompt, so "the same
text as one engine" is an exact check), a `redis-server` as the embedded metaserver's store where the test
needs to take the ledger away, and the router's own HTTP server.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.pdclient import metric
from tests.integration.router.conftest import HTTP, Deployment, Sim, start_sims
from tests.support.redis import RedisServer

MODEL = "sim-model"
PROMPT = "Whole requests are served by one engine"
WHOLE = "pdgate_router_undisaggregated_total"


def one_engine(sim: Sim, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    """`body` answered by `sim` alone (the oracle)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = HTTP.post(sim.url + path, json={**body, "stream": False})
    r.raise_for_status()
    return dict(r.json())


def logged(sim: Sim, mode: str) -> list[dict[str, Any]]:
    return [e for e in sim.stats(log=True)["log"] if e["mode"] == mode]


def whole_count(dep: Deployment, reason: str) -> float:
    try:
        return metric(dep.url, WHOLE, {"reason": reason})
    except AssertionError:
        return 0.0


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[Sim, Sim]]:
    p, d = start_sims([("prefill", ("--token-ids",)), ("decode", ("--token-ids",))])
    yield p, d
    p.stop()
    d.stop()


def test_a_ledger_outage_serves_requests_whole_on_a_decode(sims: tuple[Sim, Sim]) -> None:
    """The embedded metaserver's store goes away: no handoff can be recorded, so the request goes whole to
    the decode (a decode first), tagged and counted, with the one engine's answer; a router told to refuse
    answers the typed error instead. Before, every such request was pd_metaserver_unavailable."""
    p, d = sims
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    want = one_engine(d, body)["choices"][0]["text"]
    with RedisServer() as redis:
        serve = Deployment(prefill=[p.url], decode=[d.url], store=redis.url)
        refuse = Deployment(prefill=[p.url], decode=[d.url], store=redis.url, on_ledger_outage="refuse")
        with serve, refuse:
            serve.wait_available(p.id, d.id)
            refuse.wait_available(p.id, d.id)
            r = HTTP.post(serve.url + "/v1/completions", json=body)
            assert r.status_code == 200 and "x-pdgate-path" not in r.headers  # PD while the ledger is up
            redis.stop()
            d.reset()
            out = serve.openai().completions.with_raw_response.create(**body)
            assert out.headers["x-pdgate-path"] == "whole"
            assert out.parse().choices[0].text == want
            assert [e["mode"] for e in d.stats(log=True)["log"]] == ["plain"]
            assert whole_count(serve, "ledger_unavailable") == 1

            r = HTTP.post(refuse.url + "/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "pd_metaserver_unavailable", r.text
            assert "x-pdgate-path" not in r.headers


@pytest.fixture
def pair() -> Iterator[Deployment]:
    with Deployment(decode_policy="round_robin") as dep:
        dep.add_many([("prefill", ("--token-ids",)), ("decode", ("--token-ids",))])
        dep.wait_available(*(s.id for s in dep.sims))
        yield dep


@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_one_side_gone_serves_whole_on_the_other(pair: Deployment, dead: str) -> None:
    """No prefill live: the decode serves the request whole; no decode live: the prefill does (every engine
    of a PD deployment computes a prompt that comes without remote KV). A stream too, with the openai client."""
    gone = pair.by_role(dead)[0]
    [left] = [s for s in pair.sims if s is not gone]
    gone.stop(signal.SIGKILL)
    pair.wait_available(gone.id, available=False)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6}
    want = one_engine(left, body)["choices"][0]["text"]
    left.reset()
    out = pair.openai().completions.with_raw_response.create(**body)
    assert out.headers["x-pdgate-path"] == "whole" and out.parse().choices[0].text == want
    chunks = list(pair.openai().completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [e["mode"] for e in left.stats(log=True)["log"]] == ["plain", "plain"]
    assert whole_count(pair, "no_pair") == 2


def test_a_colocated_pool_serves_whole_with_both_path_whole() -> None:
    """Instances of role both, `--both-path whole`: each request is served end to end by one instance (no
    handoff, no second engine), for completions and chats, streamed or not."""
    with Deployment(both_path="whole") as dep:
        a, b = dep.add_many([("both", ("--token-ids",)), ("both", ("--token-ids",))])
        dep.wait_available(a.id, b.id)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
        want = one_engine(a, body)["choices"][0]["text"]
        messages = [{"role": "user", "content": PROMPT}]
        chat_want = one_engine(a, {"model": MODEL, "messages": messages, "max_tokens": 5}, chat=True)
        a.reset()
        b.reset()
        client = dep.openai()
        assert client.completions.create(**body).choices[0].text == want
        text = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
        assert text == want
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == chat_want["choices"][0]["message"]["content"]
        modes = [e["mode"] for s in (a, b) for e in s.stats(log=True)["log"]]
        assert modes == ["plain"] * 3
        assert whole_count(dep, "colocated") == 3
        r = httpx.post(dep.url + "/v1/completions", json=body, timeout=10)
        assert r.headers["x-pdgate-path"] == "whole"

"""The conditional decider (router/decider.py) drives the one whole-or-PD entry point (`Whole.choose`), over
real sockets with the openai client: a short prompt goes whole to the decode, a long one through PD, each
counted by its reason, and both answers are the one engine's (issue #22 item 3); whole requests run on
either side unless `--whole-on decode`.

Real parts: `pdgate-sim` engines with `--token-ids` (answers are a function of the prompt), the router's own
HTTP server with its embedded metaserver.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.pdclient import metric
from tests.integration.router.conftest import HTTP, Deployment, Sim, start_sims

MODEL = "sim-model"
DECISIONS = "pdgate_router_decisions_total"


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[Sim, Sim]]:
    p, d = start_sims([("prefill", ("--token-ids",)), ("decode", ("--token-ids",))])
    yield p, d
    p.stop()
    d.stop()


def test_short_prompts_go_whole_and_long_ones_through_pd(sims: tuple[Sim, Sim]) -> None:
    p, d = sims
    short = {"model": MODEL, "prompt": list(range(1, 17)), "max_tokens": 6}  # 16 tokens
    long = {"model": MODEL, "prompt": list(range(1, 129)), "max_tokens": 6}  # 128 tokens
    with Deployment(prefill=[p.url], decode=[d.url], disaggregation="conditional", pd_min_tokens=64) as dep:
        dep.wait_available(p.id, d.id)
        for body, path, reason in ((short, "whole", "short_prompt"), (long, "pd", "long_prompt")):
            want = HTTP.post(d.url + "/v1/completions", json=body).json()["choices"][0]["text"]
            p.reset()
            d.reset()
            out = dep.openai().completions.with_raw_response.create(**body)
            assert out.parse().choices[0].text == want
            assert out.headers.get("x-pdgate-path", "pd") == path
            assert metric(dep.url, DECISIONS, {"path": path, "reason": reason}) == 1
            prefilled = [e for e in p.stats(log=True)["log"] if e["mode"] == "prefill"]
            assert len(prefilled) == (1 if path == "pd" else 0)  # whole: the prefill never saw it


def test_mode_always_asks_no_decider(sims: tuple[Sim, Sim]) -> None:
    """Today's default: every request PD, and the decider's counter stays at zero."""
    p, d = sims
    with Deployment(prefill=[p.url], decode=[d.url]) as dep:
        dep.wait_available(p.id, d.id)
        out = dep.openai().completions.with_raw_response.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        assert "x-pdgate-path" not in out.headers
        assert metric(dep.url, DECISIONS, {"path": "whole", "reason": "short_prompt"}) == 0


def test_a_strict_tpot_slo_header_sends_a_middling_prompt_through_pd(sims: tuple[Sim, Sim]) -> None:
    """x-slo-tpot-ms (llm-d's header) reaches the decider: at or under `strict_tpot_ms` it halves the length
    threshold, so a 40-token prompt that goes whole without it goes PD with it (reason slo_tpot)."""
    p, d = sims
    body = {"model": MODEL, "prompt": list(range(1, 41)), "max_tokens": 4}  # 40 tokens: between 32 and 64
    with Deployment(prefill=[p.url], decode=[d.url], disaggregation="conditional", pd_min_tokens=64) as dep:
        dep.wait_available(p.id, d.id)
        plain = dep.openai().completions.with_raw_response.create(**body)
        assert plain.headers.get("x-pdgate-path") == "whole"
        for tpot in ("abc", "0", "-5"):  # malformed or not positive: no SLO
            out = dep.openai().completions.with_raw_response.create(**body, extra_headers={"x-slo-tpot-ms": tpot})
            assert out.headers.get("x-pdgate-path") == "whole"
        strict = dep.openai().completions.with_raw_response.create(**body, extra_headers={"X-SLO-TPOT-MS": "20"})
        assert strict.headers.get("x-pdgate-path", "pd") == "pd"
        assert strict.parse().choices[0].text == plain.parse().choices[0].text
        assert metric(dep.url, DECISIONS, {"path": "pd", "reason": "slo_tpot"}) == 1
        assert metric(dep.url, DECISIONS, {"path": "whole", "reason": "short_prompt"}) == 4


@pytest.mark.parametrize("whole_on", ["any", "decode"])
def test_whole_requests_spread_over_either_side_unless_kept_on_decodes(sims: tuple[Sim, Sim], whole_on: str) -> None:
    """`--whole-on any` (the default): short prompts the decider keeps whole run on the prefill too, by the
    decode policy's load, so a 1P1D pool serves them on both cores; `decode`: the prefill never sees one."""
    p, d = sims
    body = {"model": MODEL, "prompt": list(range(1, 17)), "max_tokens": 4, "stream": True}
    with Deployment(
        prefill=[p.url], decode=[d.url], disaggregation="conditional", pd_min_tokens=64, whole_on=whole_on
    ) as dep:
        dep.wait_available(p.id, d.id)
        for sim in (p, d):
            sim.reset()
            sim.script(token_delay=0.25)  # each stream holds its instance for about a second

        def one(_: int) -> str:
            with dep.openai().completions.with_streaming_response.create(**body) as out:
                assert out.headers.get("x-pdgate-path") == "whole"
                return "".join(c.choices[0].text for c in out.parse())

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(4)))
        assert len(set(texts)) == 1 and texts[0]
        served = {s.role: sum(e["mode"] == "plain" for e in s.stats(log=True)["log"]) for s in (p, d)}
        assert served["prefill"] + served["decode"] == 4, served
        if whole_on == "any":
            assert served["prefill"] >= 1 and served["decode"] >= 1, served
        else:
            assert served == {"prefill": 0, "decode": 4}, served
        assert metric(dep.url, DECISIONS, {"path": "whole", "reason": "short_prompt"}) == 4


def test_the_access_log_says_each_decision(sims: tuple[Sim, Sim]) -> None:
    """Issue #22 item 3: every decision is counted and shown in the access log, one note per prompt."""
    import logging

    p, d = sims
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    keep, level = Keep(), access.level
    try:
        with Deployment(prefill=[p.url], decode=[d.url], disaggregation="conditional", pd_min_tokens=64) as dep:
            # After uvicorn configured its loggers from the deployment's log level (it replaces their handlers);
            # each new connection's protocol logs only when the access logger has a handler.
            access.addHandler(keep)
            access.setLevel(logging.INFO)
            dep.wait_available(p.id, d.id)
            client = dep.openai()
            client.completions.create(model=MODEL, prompt=list(range(1, 17)), max_tokens=4)
            client.completions.create(model=MODEL, prompt=list(range(1, 129)), max_tokens=4)
            client.completions.create(model=MODEL, prompt=[list(range(1, 17)), list(range(1, 129))], max_tokens=4)
    finally:
        access.removeHandler(keep)
        access.setLevel(level)
    posts = [ln for ln in lines if '"POST /v1/completions' in ln]
    notes = [ln.rsplit(" 200 ", 1)[-1] for ln in posts]
    assert notes[:2] == ["whole:short_prompt", "pd:long_prompt"], posts
    assert sorted(notes[2].split(",")) == ["pd:long_prompt", "whole:short_prompt"], posts  # one per prompt


def test_a_pd_request_decodes_where_the_decider_weighed_it(sims: tuple[Sim, Sim]) -> None:
    """The decider's picks are PD's first try: the decode whose cache it weighed pulls the KV, and the
    policies are asked once per request. Round robin over two decodes shows it: when the PD path asked the
    decode policy again after the decider had, the turn advanced twice a request and every PD request went
    to the same decode; now they alternate."""
    p, d = sims
    [d2] = start_sims([("decode", ("--token-ids",))])
    body = {"model": MODEL, "prompt": list(range(1, 129)), "max_tokens": 4}
    try:
        with Deployment(
            prefill=[p.url],
            decode=[d.url, d2.url],
            disaggregation="conditional",
            pd_min_tokens=64,
            whole_on="decode",
            decode_policy="round_robin",
        ) as dep:
            dep.wait_available(p.id, d.id, d2.id)
            for sim in (p, d, d2):
                sim.reset()
            for _ in range(4):
                out = dep.openai().completions.with_raw_response.create(**body)
                assert out.headers.get("x-pdgate-path", "pd") == "pd"
            decoded = [sum(e["mode"] == "decode" for e in s.stats(log=True)["log"]) for s in (d, d2)]
            assert decoded == [2, 2], decoded
            assert metric(dep.url, DECISIONS, {"path": "pd", "reason": "long_prompt"}) == 4
    finally:
        d2.stop()

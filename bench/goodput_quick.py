"""The quick mode's check on the conditional setup (what tests/e2e/test_12_goodput_quick.py asserts, kept
here so `bench/goodput.py --quick` fails on its own when the decider does not do its job on real vLLM):
one short and one long token-id prompt, greedy, through the conditional router; the router must count a
`whole` and a `pd` decision (`pdgate_router_decisions_total`) and both answers must equal one engine's
answer to the same request sent to it directly (the prefill engine: whole requests run on the decode,
so the comparison is with an engine the router did not use for either path)."""

from __future__ import annotations

from typing import Any

from goodput_run import DECISIONS
from goodput_setups import Running

from tests.e2e.pdclient import complete, openai_client, prompt_ids, scrape


def _decisions(url: str) -> dict[str, float]:
    return {f"{lab.get('path')}:{lab.get('reason')}": v for n, lab, v in scrape(url) if n == DECISIONS}


def decider_check(run: Running, pd_min_tokens: int) -> dict[str, Any]:
    """Both paths taken, each answer equal to the one instance's; `pass` and the `problems` found."""
    assert run.direct_url is not None, "the conditional setup names an engine to compare with"
    router, direct = openai_client(run.url + "/v1"), openai_client(run.direct_url + "/v1")
    prompts = {"short": prompt_ids(64, seed=2200), "long": prompt_ids(pd_min_tokens + 256, seed=2201)}
    before = _decisions(run.url)
    problems: list[str] = []
    paths: dict[str, str | None] = {}
    for name, prompt in prompts.items():
        got, want = complete(router, prompt, max_tokens=16), complete(direct, prompt, max_tokens=16)
        paths[name] = got.headers.get("x-pdgate-path")
        if not got.same_output(want):
            problems.append(f"{name} prompt ({len(prompt)} tokens): router {got.token_ids} != engine {want.token_ids}")
    after = _decisions(run.url)
    taken = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    for path in ("whole", "pd"):
        if not any(k.startswith(path + ":") for k in taken):
            problems.append(f"the decider never chose {path} ({taken or 'no decision counted'})")
    return {"pass": not problems, "problems": problems, "decisions": taken, "x_pdgate_path": paths}

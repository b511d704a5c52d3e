"""Eight requests in flight at once through 1P1D: every answer equals the single instance's.

The baseline answers are taken one by one beforehand, so a difference can only come from the PD
path under concurrency (mixed-up transfers, blocks freed too early, a decode reading another
request's KV), not from batching inside the baseline.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack

from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import Answer, chat, chat_messages, complete, delta, prompt_ids, settled

pytestmark = pytest.mark.e2e


def test_eight_concurrent_requests_match_the_single_instance(
    pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    lengths = [40, 64, 97, 150, 300, 700, 1200, 2000]
    cases: list[tuple[str, object, bool]] = []
    for i, length in enumerate(lengths):
        if i % 4 == 3:
            cases.append(("chat", chat_messages(10 + 40 * i, seed=400 + i), i % 2 == 1))
        else:
            cases.append(("completion", prompt_ids(length, seed=400 + i), i % 2 == 1))
    wanted = [
        baseline.chat(payload) if kind == "chat" else baseline.complete(payload)  # type: ignore[arg-type]
        for kind, payload, _ in cases
    ]
    [decode] = pd_stack.by_role("decode")
    before = settled(decode)

    def send(case: tuple[str, object, bool]) -> Answer:
        kind, payload, stream = case
        if kind == "chat":
            return chat(router_client, payload, stream=stream)  # type: ignore[arg-type]
        return complete(router_client, payload, stream=stream)  # type: ignore[arg-type]

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        answers = list(pool.map(send, cases))

    for (kind, _, stream), got, want in zip(cases, answers, wanted, strict=True):
        assert got.token_ids == want.token_ids, f"{kind} (stream={stream}) differs from the single instance"
        assert got.text == want.text
    # Every one of them went through a KV transfer (fresh prompts: nothing was cached on decode).
    assert delta(settled(decode), before)["recv_started"] == len(cases)
    assert len({a.headers["x-request-id"] for a in answers}) == len(cases)

"""Negative control: a decode whose connector corrupts the bytes it pulls (test-only option
`corrupt_pulled_bytes`) answers differently from the single instance. So the equality in the other
tests comes from the transferred KV, not from decode quietly recomputing the prompt.

It swaps the main stack's decode for a corrupting one, so it runs last on the main stack and stops
the stack when done.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pdgate.deploy.local.stack import InstanceHandle, LocalStack

from tests.e2e.conftest import Baseline, Stacks
from tests.e2e.pdclient import complete, delta, openai_client, prompt_ids, settled, wait_for

pytestmark = pytest.mark.e2e


def _available_decodes(stack: LocalStack) -> set[str]:
    with httpx.Client(timeout=10, trust_env=False) as client:
        body = client.get(stack.url + "/health", headers=stack.admin_headers).json()  # ids: the admin's view
    return {i["id"] for i in body["instances"] if i["role"] == "decode" and i["available"]}


@pytest.fixture
def corrupting_stack(stacks: Stacks) -> Iterator[tuple[LocalStack, InstanceHandle]]:
    stack = stacks.main()
    try:
        for old in stack.by_role("decode"):
            stack.remove_instance(old)
        bad = stack.add_instance("decode", extra={"corrupt_pulled_bytes": True})
        wait_for(
            lambda: _available_decodes(stack) == {bad.instance_id},
            timeout=60,
            what="the router to route to the corrupting decode only",
        )
        yield stack, bad
    finally:
        stacks.stop_main()  # nothing after this test may see the corrupting decode


def test_corrupted_kv_changes_the_output(
    corrupting_stack: tuple[LocalStack, InstanceHandle], baseline: Baseline
) -> None:
    stack, bad = corrupting_stack
    client = openai_client(stack.openai_base_url)
    before = settled(bad)
    prompts = [prompt_ids(n, seed=800) for n in (64, 300, 1000)]
    for prompt in prompts:
        got = complete(client, prompt)
        want = baseline.complete(prompt)
        assert got.token_ids != want.token_ids, f"corrupted KV gave the baseline output ({len(prompt)} tokens)"
    d = delta(settled(bad), before)  # the stats file trails the last answer by up to 0.2 s
    # The corruption hit KV that really was pulled and used: the loads succeeded, nothing was recomputed.
    assert d["recv_ok"] == len(prompts) and d["recv_failed"] == 0, d
    assert d["blocks_pulled"] >= sum(len(p) // 32 for p in prompts), d
    assert d["tokens_local_compute"] < 32 * len(prompts), d

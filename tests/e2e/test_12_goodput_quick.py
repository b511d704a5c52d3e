"""The goodput benchmark's quick mode (issue #22 item 1): the conditional decider on real vLLM takes each
path at least once, and either path answers what the single instance answers, token for token.

A 1P1D stack (test_16's engines, `conftest.EventsStack`) through a router of its own that follows no KV
events and runs `--disaggregation conditional --pd-min-tokens 256`: a 64-token prompt is
short (whole, on one instance), a 600-token prompt is long (PD, its KV pulled by the decode). Both go
non-streamed and streamed, greedy, with token-id prompts. The router's `pdgate_router_decisions_total`
must count both paths under the rules that apply (short_prompt, long_prompt); the decode's connector
must have pulled KV for the long prompts only, so a decider that labels a request "pd" and still runs it
whole (or the reverse) fails here too. `bench/goodput.py --quick` runs the same check before its sweep.

Then a conversation's second turn (issue #22 item 4): its prompt is the first turn's prompt, answer and a
new message, and the decode already holds the first turn's blocks in its prefix cache, so the transfer
covers only the blocks beyond them, and the answer is still the single instance's.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Baseline, EventsStack, RouterReplica
from tests.e2e.pdclient import complete, delta, openai_client, prompt_ids, scrape, settled

pytestmark = pytest.mark.e2e

SHORT, LONG = 64, 600
BLOCK = 32  # the stack's block size
DECISIONS = "pdgate_router_decisions_total"


def decisions(router_url: str) -> dict[tuple[str, str], float]:
    """(path, reason) -> requests the decider sent that way, from the router's /metrics."""
    return {(lab["path"], lab["reason"]): v for n, lab, v in scrape(router_url) if n == DECISIONS}


@pytest.fixture(scope="module")
def conditional_stack(events_stack: EventsStack) -> RouterReplica:
    """test_16's engines, through a router of this module's own that follows no KV events."""
    return events_stack.replica("router-goodput-quick", "--disaggregation", "conditional", "--pd-min-tokens", "256")


def test_decider_takes_each_path_with_the_single_instances_output(
    conditional_stack: RouterReplica, baseline: Baseline
) -> None:
    stack = conditional_stack
    [decode] = stack.by_role("decode")
    client = openai_client(stack.openai_base_url)
    short, long = prompt_ids(SHORT, seed=1200), prompt_ids(LONG, seed=1201)
    before, pulled_before = decisions(stack.url), settled(decode)
    for prompt, whole in ((short, True), (long, False)):
        want = baseline.complete(prompt)
        for stream in (False, True):
            got = complete(client, prompt, stream=stream)
            assert got.same_output(want), f"{len(prompt)}-token prompt, stream={stream}: {got} != {want}"
            path = got.headers.get("x-pdgate-path")
            assert (path == "whole") is whole, f"{len(prompt)}-token prompt, stream={stream}: X-PDGate-Path {path}"
    after = decisions(stack.url)
    taken = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert taken.get(("whole", "short_prompt")) == 2, taken
    assert taken.get(("pd", "long_prompt")) == 2, taken
    assert sum(taken.values()) == 4, taken
    pulled = delta(settled(decode), pulled_before)
    # KV moved for the two long requests and for nothing else: the path counted is the path taken. The first
    # pulled the whole prompt; the second (the same prompt) only what the decode's prefix cache lacked.
    assert pulled.get("recv_ok") == 2 and pulled.get("recv_failed", 0.0) == 0, pulled
    assert LONG // 32 <= pulled.get("blocks_pulled", 0.0) < 2 * (LONG // 32), pulled


def test_a_second_turn_pulls_only_the_blocks_the_decode_lacks(
    conditional_stack: RouterReplica, baseline: Baseline
) -> None:
    stack = conditional_stack
    [decode] = stack.by_role("decode")
    client = openai_client(stack.openai_base_url)
    first = prompt_ids(LONG, seed=1300)
    turn1 = complete(client, first)
    assert turn1.same_output(baseline.complete(first)), "turn 1"
    second = first + list(turn1.token_ids) + prompt_ids(300, seed=1301)  # the new message: 300 tokens
    want = baseline.complete(second)
    before = settled(decode)
    turn2 = complete(client, second)
    pulled = delta(settled(decode), before)
    assert turn2.same_output(want), f"turn 2: {turn2} != {want}"
    assert turn2.headers.get("x-pdgate-path", "pd") == "pd"  # long, and no KV events say what D caches
    assert pulled.get("recv_ok") == 1 and pulled.get("recv_failed", 0.0) == 0, pulled
    # At most the blocks past the first prompt's full blocks (the decode cached those in turn 1), never the
    # whole prompt's 29.
    full, new = -(-len(second) // BLOCK), -(-(len(second) - len(first) // BLOCK * BLOCK) // BLOCK)
    assert 1 <= pulled.get("blocks_pulled", 0.0) <= new < full, (pulled, new, full)

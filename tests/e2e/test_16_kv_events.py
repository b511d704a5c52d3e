"""The engines' KV events reach the router on real vLLM, and the decider and the policy act on them
(issue #22 item 4: "precise where the engines say what they hold").

A 1P1D stack (`conftest.EventsStack`, on a redis store; test_12 runs on its engines first, through a
router of its own) whose engines publish their prefix-cache events (`StackConfig.kv_events`: vLLM's zmq
publisher over ipc sockets) and whose router follows them (`--kv-events`), routes with `cache_aware` on both sides
and decides with `--disaggregation conditional --pd-min-tokens 256`. Turn 1 of a conversation (600
tokens) goes PD: nobody holds it. Turn 2 (turn 1's prompt, its answer and 100 new tokens) is long, but the
index knows the decode already holds all but its last 104 tokens, so the decider keeps it whole
(`decode_cached`) on the instance that holds the most (the decode, which also cached the answer's full
block): no KV moves, the engine reports the prefix it reused, and the answer is still the single
instance's. Without events (test_12) the same second turn goes PD. This is the only place the router's
block hashes (`kv_index.BlockHasher`) are checked against what a real engine publishes.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pdgate.deploy.local.stack import LocalStack

from tests.e2e.conftest import Baseline, EventsStack
from tests.e2e.pdclient import complete, delta, openai_client, prompt_ids, scrape, settled, wait_for

pytestmark = pytest.mark.e2e

BLOCK = 32  # the stack's block size
FIRST, NEW = 600, 100


def status_rows(stack: LocalStack) -> list[dict[str, object]]:
    """The router's instance rows as an admin reads them (`/status/data`: each engine's reported load)."""
    resp = httpx.get(stack.url + "/status/data", headers=stack.admin_headers, timeout=10)
    rows: list[dict[str, object]] = resp.raise_for_status().json()["instances"]
    return rows


def counter(router_url: str, name: str, labels: dict[str, str]) -> float:
    return sum(v for n, lab, v in scrape(router_url) if n == name and all(lab.get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def kv_events_stack(events_stack: EventsStack) -> Iterator[LocalStack]:
    yield events_stack.stack()
    events_stack.stop()  # test_12's engines too: it ran just before (conftest's order)


def test_the_decode_s_published_blocks_keep_a_second_turn_whole_on_it(
    kv_events_stack: LocalStack, baseline: Baseline
) -> None:
    stack = kv_events_stack
    [decode] = stack.by_role("decode")
    client = openai_client(stack.openai_base_url)
    applied = "pdgate_router_kv_event_batches_total"
    first = prompt_ids(FIRST, seed=1400)
    before = counter(stack.url, applied, {"outcome": "applied"})
    turn1 = complete(client, first)
    assert turn1.same_output(baseline.complete(first)), "turn 1"
    assert turn1.headers.get("x-pdgate-path", "pd") == "pd"  # nobody held it: long, so PD
    # The engine's own count of reused tokens on turn 2 will be the decode's full blocks of turn 1 (prompt
    # and answer). The prefill holds only the prompt's 18 blocks, so this number also says which instance
    # served it. The decode publishes the answer's block in a later batch than the loaded ones: wait for the
    # router's index to hold all of it (a count of batches raced it: CI saw 576 once).
    [prefill] = stack.by_role("prefill")
    held = (FIRST + len(turn1.token_ids)) // BLOCK * BLOCK
    assert held > FIRST // BLOCK * BLOCK
    index_blocks = "pdgate_router_kv_index_blocks"
    wait_for(
        lambda: (
            counter(stack.url, index_blocks, {"instance": decode.instance_id}) >= held // BLOCK
            and counter(stack.url, index_blocks, {"instance": prefill.instance_id}) >= FIRST // BLOCK
        ),
        timeout=20,
        what="the router's index to hold both engines' blocks of turn 1",
    )
    # cache_aware weighs the prefix against load, and an engine's report trails its work by a heartbeat.
    # The router discounts its own requests that were in flight when a report came in (`LiveInstance.others`),
    # but a report taken during turn 1 and read after it ended still counts turn 1 as someone else's until
    # the next one; then the idle prefill's 18 blocks outscore the decode's 19 and turn 2 runs there (CI saw
    # 576). Wait for both reports to say idle, as a quiet cluster would.
    wait_for(
        lambda: all(row.get("load") == 0 for row in status_rows(stack)),
        timeout=20,
        what="both engines to report no request running",
    )
    assert counter(stack.url, applied, {"outcome": "applied"}) >= before + 2
    assert counter(stack.url, applied, {"outcome": "gap"}) == 0

    second = first + list(turn1.token_ids) + prompt_ids(NEW, seed=1401)
    want = baseline.complete(second)
    pulled_before = settled(decode)
    turn2 = complete(client, second)
    assert turn2.same_output(want), f"turn 2: {turn2} != {want}"
    assert turn2.headers.get("x-pdgate-path") == "whole"
    assert counter(stack.url, "pdgate_router_decisions_total", {"path": "whole", "reason": "decode_cached"}) == 1
    assert delta(settled(decode), pulled_before).get("recv_ok", 0.0) == 0  # no KV moved for it
    assert turn2.cached_tokens == held, (turn2.cached_tokens, held)

"""Layer-wise loading on real vLLM (issue #23): vLLM's own scheduler and model runner drive the connector's
hooks, behind pdgate-router, over NIXL.

A 1P1D stack whose decode loads layer by layer from `MIN_TOKENS` tokens on (`layerwise_min_tokens`). Each
request goes to an idle decode, so its KV is a synchronous load (`sync_load_when_idle`), the only kind that
goes layer by layer. Prompts above the threshold, non-streamed and streamed, must give the single
instance's greedy tokens, and must have been loaded layer by layer: the decode's connector counts each
layer-wise load (`recv_layerwise`) and each wait of vLLM's forward for one of its layers (`layer_waits`,
one per model layer, none out of order), and its log line for the transfer lists the layers in the order
the forward waited for them. A prompt below the threshold is loaded whole (counted by `recv_ok`, not by
`recv_layerwise`) and is equal too. Afterwards the ledger holds no live handoff and the prefill no block.
Last, the decode is swapped for a faulty one (TEST ONLY options): its read of layer 1 fails, so a
layer-wise load fails typed and nothing is held; and it XORs the bytes of every whole load, the negative
control of every equality test here and in the other modules: a decode using corrupted pulled KV must answer
differently from the single instance, so the equality comes from the transferred KV, not from a decode
quietly recomputing the prompt. (One engine carries both faults: each is an engine start saved in CI.)

Why this stack works where the dropped two-server test (commit 30d7aaf) did not: see docs/TRANSFER.md
("Layer-wise", end-to-end evidence).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import pytest
from pdgate.deploy.local.stack import InstanceHandle, LocalStack
from pdgate.deploy.local.tiny_model import ModelShape

from pdgate.models import HandoffState
from tests.e2e.conftest import Baseline, Stacks
from tests.e2e.pdclient import (
    complete,
    delta,
    get_handoff,
    live_handoffs,
    observe,
    openai_client,
    prompt_ids,
    settled,
    wait_for,
)

pytestmark = pytest.mark.e2e

BLOCK = 32  # the stack's block size
MIN_TOKENS = 128  # 4 blocks: a load of at least this many tokens (in whole blocks) goes layer by layer
LONG = ((200, False), (333, True), (480, False), (700, True))  # (prompt tokens, streamed)
SHORT = 90  # 3 blocks (96 tokens, the last one partial): loaded whole
LAYERS = ModelShape.num_layers
LINE = re.compile(r"loaded layer by layer \((?P<how>[^)]*)\): (?P<n>\d+) layers.*in wait order: (?P<waits>[^)]*)\)")


@pytest.fixture(scope="module")
def layerwise_stack(stacks: Stacks) -> Iterator[LocalStack]:
    stacks.stop_main()  # free the cores and memory: this module needs a decode configured its own way
    stack = stacks.start("layerwise", decode_extra={"layerwise_min_tokens": MIN_TOKENS})
    try:
        yield stack
    finally:
        stack.stop()


def layer_lines(decode: InstanceHandle, transfer_id: str) -> list[re.Match[str]]:
    """The decode's one log line per layer-wise load of `transfer_id` (`WorkerHalf._log_layered`)."""
    text = decode.log_path.read_text(errors="replace")
    return [m for line in text.splitlines() if transfer_id in line and (m := LINE.search(line))]


def test_layer_wise_loads_give_the_single_instances_tokens(layerwise_stack: LocalStack, baseline: Baseline) -> None:
    stack = layerwise_stack
    [prefill] = stack.by_role("prefill")
    [decode] = stack.by_role("decode")
    client = openai_client(stack.openai_base_url)
    d0, p0 = settled(decode), settled(prefill)
    tids = []
    for i, (length, stream) in enumerate(LONG):
        prompt = prompt_ids(length, seed=1500 + i)  # a new prompt each: the decode's prefix cache has none of it
        want = baseline.complete(prompt)
        got = complete(client, prompt, stream=stream)
        assert got.same_output(want), f"{length}-token prompt, stream={stream}: {got} != {want}"
        tids.append(got.headers["x-request-id"])
    wait_for(lambda: delta(observe(decode), d0)["recv_ok"] >= len(LONG), timeout=30, what="the decode to count")
    d = delta(settled(decode), d0)
    n = len(LONG)
    # Each load went layer by layer in vLLM's forward: one wait per model layer, in layer order.
    assert d["recv_ok"] == n and d["recv_sync"] == n and d["recv_failed"] == 0, d
    assert d["recv_layerwise"] == n, d
    assert d["layer_waits"] == n * LAYERS and d["layer_waits_out_of_order"] == 0, d
    # Every block of each prompt, the last (partial) one included, as test_02 counts them.
    assert d["blocks_pulled"] == sum(math.ceil(length / BLOCK) for length, _ in LONG), d
    assert d["tokens_external_kv_transfer"] >= sum(length - 1 for length, _ in LONG), d
    for tid in tids:
        [line] = layer_lines(decode, tid)
        assert line["how"] == "ok" and int(line["n"]) == LAYERS, line.group(0)
        order = [int(w.split(":")[0]) for w in line["waits"].split()]
        assert order == list(range(LAYERS)), line.group(0)
    assert delta(settled(prefill), p0)["sends_held"] == n
    meta, token = stack.metaserver_url, stack.admin_token
    wait_for(
        lambda: all(get_handoff(meta, t, token).state.terminal for t in tids), timeout=60, what="every handoff to end"
    )
    assert {get_handoff(meta, t, token).state for t in tids} == {HandoffState.DONE}


def test_a_prompt_below_the_threshold_is_loaded_whole(layerwise_stack: LocalStack, baseline: Baseline) -> None:
    [decode] = layerwise_stack.by_role("decode")
    prompt = prompt_ids(SHORT, seed=1510)
    want = baseline.complete(prompt)
    d0 = settled(decode)
    got = complete(openai_client(layerwise_stack.openai_base_url), prompt)
    assert got.same_output(want), f"{got} != {want}"
    wait_for(lambda: delta(observe(decode), d0)["recv_ok"] >= 1, timeout=30, what="the decode to count the pull")
    d = delta(settled(decode), d0)
    assert d["recv_ok"] == 1 and d["blocks_pulled"] == math.ceil(SHORT / BLOCK), d
    assert d["recv_layerwise"] == 0 and d["layer_waits"] == 0, d
    assert layer_lines(decode, got.headers["x-request-id"]) == []


def test_nothing_is_held_afterwards(layerwise_stack: LocalStack) -> None:
    stack = layerwise_stack
    [prefill] = stack.by_role("prefill")
    [decode] = stack.by_role("decode")
    wait_for(
        lambda: not live_handoffs(stack.metaserver_url, stack.admin_token),
        timeout=60,
        what="no live handoff in the ledger",
    )
    wait_for(lambda: observe(prefill).get("holding", 0) == 0, timeout=60, what="the prefill to free every block")
    wait_for(lambda: observe(decode)["running"] == 0, timeout=60, what="the decode to go idle")
    p = settled(prefill)
    assert p["sends_held"] == p["sends_freed_done"], p
    assert p["sends_freed_expired"] == 0 and p["sends_freed_local_deadline"] == 0, p
    assert settled(decode)["done_refused"] == 0


@pytest.fixture(scope="module")
def faulty_decode(layerwise_stack: LocalStack) -> InstanceHandle:
    """The stack's decode swapped for one whose read of layer 1 fails (`test_fail_layer`) and whose whole loads
    are XORed (`corrupt_pulled_bytes`); the tests that use it come last in the module."""
    stack = layerwise_stack
    [good] = stack.by_role("decode")
    stack.remove_instance(good)
    bad = stack.add_instance("decode", extra={"test_fail_layer": 1, "corrupt_pulled_bytes": True})
    stack.wait_router_ready()
    return bad


def test_a_read_failed_at_layer_1_fails_the_load_typed_and_holds_nothing(
    layerwise_stack: LocalStack, faulty_decode: InstanceHandle, baseline: Baseline
) -> None:
    """vLLM fails the request (`kv_load_failure_policy: fail`, its default), the connector names the
    transport's typed error, the handoff is aborted so the prefill frees, and the router answers the request
    whole (computed on an instance, so nothing corrupted is used)."""
    stack, bad = layerwise_stack, faulty_decode
    [prefill] = stack.by_role("prefill")
    prompt = prompt_ids(300, seed=1520)
    want = baseline.complete(prompt)
    d0, p0 = settled(bad), settled(prefill)
    got = complete(openai_client(stack.openai_base_url), prompt)
    assert got.same_output(want), f"{got} != {want}"
    assert got.headers.get("x-pdgate-path") == "whole", got.headers  # the router's answer after the failed load
    tid = got.headers["x-request-id"]
    wait_for(lambda: delta(observe(bad), d0)["recv_failed"] >= 1, timeout=30, what="the decode to count the failure")
    d = delta(settled(bad), d0)
    assert d["recv_layerwise"] == 1 and d["layer_waits"] == LAYERS, d  # it failed inside a layer-wise load
    assert d["recv_failed"] == 1 and d["pulls_failed"] == 1 and d["recv_ok"] == 0, d
    assert d["finished_error"] == 1 and d["invalid_blocks"] == math.ceil(300 / BLOCK), d  # every block of the load
    [line] = layer_lines(bad, tid)
    assert line["how"] == "failed: transport_engine_error", line.group(0)
    meta, token = stack.metaserver_url, stack.admin_token
    wait_for(lambda: get_handoff(meta, tid, token).state.terminal, timeout=60, what="the handoff to end")
    record = get_handoff(meta, tid, token)
    assert record.state is HandoffState.ABORTED, record
    wait_for(lambda: not live_handoffs(meta, token), timeout=60, what="no live handoff in the ledger")
    wait_for(lambda: observe(prefill).get("holding", 0) == 0, timeout=60, what="the prefill to free every block")
    p = delta(settled(prefill), p0)
    assert p["sends_freed_aborted"] >= 1 and p["sends_freed_expired"] == 0, p
    assert p["sends_held"] == p["sends_freed_aborted"] + p["sends_freed_done"], p


def test_corrupted_kv_changes_the_output(
    layerwise_stack: LocalStack, faulty_decode: InstanceHandle, baseline: Baseline
) -> None:
    """The negative control: prompts below `MIN_TOKENS` are loaded whole, and XORed; the answers must differ
    from the single instance's although every load succeeded and nothing was recomputed."""
    bad = faulty_decode
    client = openai_client(layerwise_stack.openai_base_url)
    before = settled(bad)
    prompts = [prompt_ids(n, seed=800) for n in (40, 64, SHORT)]
    for prompt in prompts:
        assert len(prompt) < MIN_TOKENS
        got = complete(client, prompt)
        assert got.headers.get("x-pdgate-path") != "whole", got.headers  # the decode pulled the KV
        want = baseline.complete(prompt)
        assert got.token_ids != want.token_ids, f"corrupted KV gave the baseline output ({len(prompt)} tokens)"
    d = delta(settled(bad), before)  # the stats file trails the last answer by up to 0.2 s
    # The corruption hit KV that really was pulled and used: the loads succeeded, nothing was recomputed.
    assert d["recv_ok"] == len(prompts) and d["recv_failed"] == 0 and d["recv_layerwise"] == 0, d
    assert d["blocks_pulled"] >= sum(len(p) // BLOCK for p in prompts), d
    assert d["tokens_local_compute"] < BLOCK * len(prompts), d

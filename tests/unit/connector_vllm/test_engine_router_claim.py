"""The engine loop (`test_engine_loop.py`, harness in `engine_support.py`) under the router's claim: the
decode sends no claim of its own; an idle decode loads synchronously, in the step that computes its
first token; otherwise the first forward follows the pull by one step; siblings (n > 1) share the claim.
"""

from __future__ import annotations

import pytest
import torch
from pdgate.connector import worker

from pdgate.models import HandoffState
from tests.support.servers import UvicornThread
from tests.unit.connector_vllm.conftest import LAYERS, make_request
from tests.unit.connector_vllm.engine_support import (
    NUM_BLOCKS,
    Engine,
    claimed_for,
    first_forward,
    new_handoff,
    prefill,
    registered,
    routers_claim,
    run_until,
    state,
)


def test_an_idle_decode_under_the_routers_claim_pulls_in_the_step_that_computes_its_first_token(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """vLLM's own scheduler with the synchronous load (the decode has no other request): the step that
    allocates the request's blocks also computes its last prompt token; the worker pulled in
    `start_load_kv`, before that forward, so the blocks hold the prefill's bytes by then; vLLM gets no
    finished-receiving report for it; DONE is recorded afterwards and the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, claimed = routers_claim(url, p, d)
    p_blocks = p.block_ids("p1")
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    so = d.step()
    assert so.num_scheduled_tokens == {"d1": 1}  # the first forward, in the allocation step
    assert d.sched.requests["d1"].num_computed_tokens == 70
    d_blocks = d.block_ids("d1")
    for name in LAYERS:
        assert torch.equal(d.kv[name][d_blocks], p.kv[name][p_blocks])  # landed before that forward
    assert "d1" in d.outputs and d.outputs["d1"].new_token_ids == [7]  # its first token, from that step
    run_until(lambda: "d1" in d.outputs and d.outputs["d1"].finish_reason is not None, [p, d], what="decode")
    assert "d1" not in d.finished_recving  # vLLM expects no report of a synchronous load
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE, off the path")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 1, [p, d], what="stats")
    dc = d.counters()
    assert (dc["recv_sync"], dc["claims_by_router"], dc["claims_failed"], dc["invalid_blocks"]) == (1, 1, 0, 0)
    assert dc["tokens_loaded"] == 69  # the decode computed the last prompt token itself


def test_a_synchronous_load_that_fails_fails_the_request_in_its_step(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """The prefill's blocks cannot be read (the router sealed a location with a block the prefill does not
    have): the worker marks the blocks as load errors in the very step, vLLM drops that step's token and,
    under the `fail` policy, ends the request with an error; the handoff is aborted so the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = prefill(p, url, tid, kv_key, prompt_len=70)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    bad = dict(params)
    bad["remote_location"] = dict(params["remote_location"])
    bad["remote_location"]["block_ids"] = [[NUM_BLOCKS + 5] * len(params["remote_location"]["block_ids"][0])]
    claimed = claimed_for(url, d, tid, bad)
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    so = d.step()
    assert so.num_scheduled_tokens == {"d1": 1}
    out = d.outputs["d1"]
    assert out.finish_reason is not None and out.new_token_ids == []  # failed, nothing sampled reaches it
    run_until(lambda: state(url, tid) is HandoffState.ABORTED, [p, d], what="the handoff aborted")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_failed") == 1, [p, d], what="stats")
    assert d.counters()["recv_sync"] == 1


@pytest.mark.parametrize("engines", [{"sync_load_when_idle": False}], indirect=True)
def test_under_the_routers_claim_the_first_forward_follows_the_pull_by_one_step(
    engines: tuple[Engine, Engine], metaserver: UvicornThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asynchronous load (the synchronous one switched off, as when the decode has other requests):
    what the router does (claims for the decode it picked, passes the claim in kv_transfer_params),
    then vLLM's own scheduler: the decode sends no claim, the worker reports the pull finished in the
    step that started it (a step that computes nothing waits for its pull), and the request's first
    forward is the very next step (no step through the scheduler half). DONE is recorded afterwards, and
    the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, claimed = routers_claim(url, p, d)

    # The decode computes nothing else, so the step that starts the pull waits for it (worker.py); the
    # bound is set long so that the pull's end (a first NIXL contact here), not a timer, ends the wait.
    monkeypatch.setattr(worker, "_IDLE_WAIT_S", 60.0)
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    allocated = d.steps + 1
    first = first_forward(d, "d1")
    assert d.finished_recving["d1"] == d.outcome_steps["d1"] == allocated  # reported in the step that pulled
    assert first == allocated + 1  # and computed in the next one
    run_until(lambda: "d1" in d.outputs, [p, d], what="decode")
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE, off the path")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 1, [p, d], what="stats")
    dc = d.counters()
    assert (dc["claims_by_router"], dc["claims_failed"], dc["done_refused"], dc["tokens_loaded"]) == (1, 0, 0, 70)


def test_siblings_of_one_handoff_each_load_the_prefills_blocks_and_done_follows_the_last(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """vLLM's n > 1: the decode gets one child request per sample, all with the same kv_transfer_params
    (what vLLM's parallel sampling does with the router's request). Both read the prefill's bytes over
    NIXL into their own blocks under one claim; the ledger says DONE once, and the prefill frees then."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = prefill(p, url, tid, kv_key, prompt_len=70)
    p_blocks = p.block_ids("p1")
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    shared = claimed_for(url, d, tid, params, siblings=2)
    for i in range(2):
        d.sched.add_request(make_request(f"{i}_d1", 70, shared, max_tokens=3))
    d.step()
    blocks = {rid: d.block_ids(rid) for rid in ("0_d1", "1_d1")}
    assert set(blocks["0_d1"]).isdisjoint(blocks["1_d1"])
    run_until(lambda: {"0_d1", "1_d1"} <= set(d.outputs), [p, d], what="both siblings decoded")
    for rid, mine in blocks.items():
        for name in LAYERS:
            assert torch.equal(d.kv[name][mine], p.kv[name][p_blocks]), rid
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE after the last sibling")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 2, [p, d], what="stats")
    assert (d.counters()["recv_failed"], d.counters()["done_refused"]) == (0, 0)

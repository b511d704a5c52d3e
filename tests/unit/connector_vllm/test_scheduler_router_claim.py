"""The decode side under the router's claim (`scheduler_decode.py`, module doc): no claim round trip, the
workers report the pull themselves, and the synchronous load of an idle engine (`decode_load.py`); driven
with vLLM's own Request and KV blocks, without I/O, as `test_scheduler_decode.py` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pdgate.connector.messages import (
    Abort,
    Claim,
    Done,
    DoneResult,
)
from pdgate.connector.metadata import PullOutcome, RecvDone
from vllm.v1.request import RequestStatus

from pdgate.contract import with_claim
from pdgate.errors import Code
from tests.unit.connector_vllm.conftest import make_blocks, make_request
from tests.unit.connector_vllm.scheduler_support import (
    d_params,
    early_params,
    finish,
    half,
    handoff,
    router_claimed,
    router_params,
)

# ---- decode: the router's claim (no claim round trip, the workers report the pull themselves) ------


def test_a_claim_the_router_made_for_this_instance_skips_the_claim_round_trip() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, router_params()), make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == []  # no Claim: the pull starts at allocation
    (plan,) = h.build([], now=0.0).pulls
    assert plan.trusted_until == 995.0 and plan.local_block_ids == (1, 2)
    # The worker reported the request itself in the step the pull ended: DONE goes out, off the path,
    # and the scheduler half sends no RecvDone of its own (it would be a second report).
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2, reported=True)], now=0.01)
    assert h.take_commands() == [Done("t-1")]
    assert h.build([], now=0.01).recv_done == ()
    c = h.counters
    assert (c["recv_ok"], c["claims_by_router"], c["tokens_loaded"]) == (1, 1, 40)
    assert h.snapshot()["claim_ms"] == {"n": 1, "p50": 0.0, "p99": 0.0, "max": 0.0}


# ---- decode: the synchronous load of an idle engine (decode_load.py) --------------------------------------


def test_the_only_request_under_the_routers_claim_loads_synchronously_and_done_follows_its_token() -> None:
    h = half()
    req = make_request("d1", 40, router_params())
    h.on_new_request(req)
    # All but the last prompt token, not async: vLLM computes that one in the allocation step.
    assert h.get_num_new_matched_tokens(req, 0) == (39, False)
    # vLLM caches a synchronous load's blocks at allocation: every block carries a hash already.
    h.update_state_after_alloc(req, make_blocks([1, 2], cached=2), 39, now=0.0)
    assert h.take_commands() == []
    (plan,) = h.build([], now=0.0).pulls
    assert (plan.sync, plan.local_block_ids, plan.remote_block_ids, plan.trusted_until) == (True, (1, 2), (7, 8), 995.0)
    # The outcome comes with the first token's step; DONE waits a few ms, off that token's way out.
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2, reported=True, waited_s=0.001)], now=0.01)
    assert h.take_commands() == []
    assert h.build([], now=0.011).recv_done == () and h.take_commands() == []
    assert h.build([], now=0.02).recv_done == ()  # vLLM expects no report of a synchronous load
    assert h.take_commands() == [Done("t-1")]
    c = h.counters
    assert (c["recv_sync"], c["recv_ok"], c["claims_by_router"], c["tokens_loaded"]) == (1, 1, 1, 39)


@pytest.mark.parametrize(
    ("prompt", "covered", "local_hit", "expected"), [(41, 40, 0, 40), (33, 32, 0, 32), (65, 64, 32, 32)]
)
def test_a_prompt_ending_with_the_prefills_first_token_loads_all_the_prefill_covered_synchronously(
    prompt: int, covered: int, local_hit: int, expected: int
) -> None:
    """The router sent the prefill's first token on (`router/first_token.py`): the decode's prompt is the
    prefill's plus that token, so the prefill covers all but the last prompt token, which vLLM computes."""
    h = half()
    req = make_request("d1", prompt, {**router_params(), "remote_num_tokens": covered})
    h.on_new_request(req)
    assert h.get_num_new_matched_tokens(req, local_hit) == (expected, False)
    # Busy, the same prompt loads asynchronously, and vLLM computes the last token after the load.
    busy = half()
    busy.on_new_request(make_request("other", 8, None))
    busy.on_new_request(req)
    assert busy.get_num_new_matched_tokens(req, local_hit) == (expected, True)


def test_a_synchronous_load_whose_request_ends_at_once_still_sends_done() -> None:
    """max_tokens=1: the step that pulled was the request's last, and no later step may come."""
    h = half()
    req = make_request("d1", 40, router_params())
    h.on_new_request(req)
    assert h.get_num_new_matched_tokens(req, 0) == (39, False)
    h.update_state_after_alloc(req, make_blocks([1, 2], cached=2), 39, now=0.0)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2, reported=True)], now=0.01)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [1, 2], now=0.0101) == (False, None)
    assert h.take_commands() == [Done("t-1")]


@pytest.mark.parametrize(
    ("why", "params", "others", "over"),
    [
        ("another request is live", router_params(), 1, {}),
        ("no claim from the router", early_params(), 0, {}),
        ("a claim for another decode", router_params(claimed_by="node-b"), 0, {}),
        ("siblings share the handoff", with_claim(router_params(), None, siblings=2), 0, {}),
        ("switched off", router_params(), 0, {"sync_load_when_idle": False}),
    ],
)
def test_a_load_stays_asynchronous(why: str, params: dict[str, Any], others: int, over: dict[str, Any]) -> None:
    h = half(**over)
    for i in range(others):
        h.on_new_request(make_request(f"other-{i}", 8, None))
    req = make_request("d1", 40, params)
    h.on_new_request(req)
    assert h.get_num_new_matched_tokens(req, 0) == (40, True), why


def test_a_synchronous_load_that_cannot_be_planned_fails_in_its_step() -> None:
    """The plan fails at allocation (here: fewer blocks recorded than the prompt needs): vLLM computes the
    request in this very step, so its blocks go out as load errors now, with no finished-receiving report."""
    h = half()
    req = make_request("d1", 40, router_params(location=handoff("t-1", [7], num_tokens=40).location))
    h.on_new_request(req)
    assert h.get_num_new_matched_tokens(req, 0) == (39, False)
    h.update_state_after_alloc(req, make_blocks([1, 2], cached=2), 39, now=0.0)
    step = h.build([], now=0.0)
    assert step.pulls == () and step.recv_done == (RecvDone("d1", False, (1, 2), sync=True),)
    assert Abort in {type(c) for c in h.take_commands()}


def test_a_router_claimed_pull_past_its_bound_is_confirmed_by_done_first() -> None:
    h = half(world_size=2, tp_size=2)
    params = router_claimed(early_params(location=handoff("t-1", [7, 8], num_tokens=40, tp_size=2).location))
    h.update_state_after_alloc(make_request("d1", 40, params), make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == []
    h.build([], now=0.0)
    # Rank 0 finished in time and reported itself; rank 1 finished past the bound.
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2, reported=True)], now=0.1)
    h.on_worker_output([PullOutcome("d1", "t-1", 1, True, nblocks=2)], now=6.0)
    assert h.take_commands() == [Done("t-1")]
    assert h.build([], now=6.0).recv_done == ()
    h.on_result(DoneResult("t-1", True), now=6.1)
    assert h.build([], now=6.1).recv_done == (RecvDone("d1", True, ranks=frozenset({1})),)


def test_a_failed_pull_under_the_routers_claim_aborts_without_a_second_report() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, router_params()), make_blocks([1, 2]), 40, now=0.0)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, False, Code.TRANSPORT_ERROR, "boom", reported=True)], now=0.1)
    assert h.build([], now=0.1).recv_done == ()  # the worker reported it, with its blocks as load errors
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and abort.transfer_id == "t-1"
    assert h.counters["recv_failed"] == 1


def test_a_claim_made_for_another_instance_is_not_trusted() -> None:
    h = half()
    h.update_state_after_alloc(
        make_request("d1", 40, router_params(claimed_by="node-b")), make_blocks([1, 2]), 40, now=0.0
    )
    assert h.take_commands() == [Claim("t-1")]
    (plan,) = h.build([], now=0.0).pulls
    assert plan.trusted_until is None
    assert h.counters["claims_untrusted"] == 0  # not a claim for us: nothing suspicious about it


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: {**p, "claim_seal": None},  # a client wrote the claim itself
        lambda p: {**p, "remote_location": {**p["remote_location"], "block_ids": [3, 4]}},  # other blocks
        lambda p: {**p, "claim_deadline": 5000.0},  # a longer claim than the ledger granted
        lambda p: router_claimed(early_params(), token="another-token"),  # a router under another token
    ],
)
def test_a_claim_the_router_did_not_seal_for_this_request_is_not_trusted(
    forge: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """What a client reaching vLLM directly could send: a claim for this decode pointing anywhere. The
    decode claims through the ledger instead, which decides where the KV is (a location that differs from
    the hint fails the load, `test_early_pull_from_a_location_the_ledger_contradicts_fails`)."""
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, forge(router_params())), make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    assert all(plan.trusted_until is None for plan in h.build([], now=0.0).pulls)
    assert (h.counters["claims_by_router"], h.counters["claims_untrusted"]) == (0, 1)


def test_a_router_claim_without_a_usable_location_claims_through_the_ledger() -> None:
    h = half()
    params = router_claimed(d_params("t-1", num_tokens=40, kv_key=9))
    h.update_state_after_alloc(make_request("d1", 40, params), make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]  # renews the router's claim for us, and says where the KV is


def test_a_refused_done_is_counted() -> None:
    h = half()
    h.on_result(DoneResult("t-9", True, Code.ILLEGAL_TRANSITION, "cannot move a READY handoff to DONE"), now=0.0)
    assert h.counters["done_refused"] == 1


def test_a_done_after_the_handoff_ended_is_counted_apart() -> None:
    h = half()
    h.on_result(DoneResult("t-9", False, Code.HANDOFF_TERMINAL, "handoff is ABORTED"), now=0.0)
    assert (h.counters["done_refused"], h.counters["done_after_end"]) == (0, 1)

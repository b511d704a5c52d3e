"""The scheduler half's decode side (`scheduler_decode.py`), driven with vLLM's own Request and KV blocks:
how many tokens a decode loads, its claim and pull, the early pull, and its failures. The router's claim
and the synchronous load are in `test_scheduler_router_claim.py`, siblings (n > 1) in
`test_scheduler_siblings.py`.

No I/O: commands are read from `take_commands()` and the control thread's answers are fed back as the
result messages it would produce. `now` is passed explicitly, so leases and deadlines need no sleeping.
"""

from __future__ import annotations

from typing import Any

import pytest
from pdgate.connector.blocks import prompt_digest
from pdgate.connector.messages import (
    Abort,
    Claim,
    Claimed,
    ClaimFailed,
    Done,
    DoneResult,
)
from pdgate.connector.metadata import PullOutcome, RecvDone
from pdgate.connector.scheduler import SchedulerHalf, idle_step
from vllm.v1.request import RequestStatus

from pdgate.errors import Code
from tests.unit.connector_vllm.conftest import make_blocks, make_request
from tests.unit.connector_vllm.scheduler_support import (
    d_params,
    early_params,
    finish,
    half,
    handoff,
    p_params,
)

# ---- decode: how many tokens -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "local_hit", "expected"),
    [(31, 0, 31), (32, 0, 32), (33, 0, 33), (33, 32, 1), (64, 32, 32), (65, 64, 1), (100, 96, 4)],
)
def test_decode_loads_every_prompt_token_beyond_the_local_hit(prompt: int, local_hit: int, expected: int) -> None:
    h = half()
    req = make_request("d1", prompt, d_params(num_tokens=prompt))
    assert h.get_num_new_matched_tokens(req, local_hit) == (expected, True)
    # Side-effect free: asking again gives the same answer and issues nothing.
    assert h.get_num_new_matched_tokens(req, local_hit) == (expected, True)
    assert h.take_commands() == []


def test_decode_loads_no_more_than_the_prefill_covered() -> None:
    h = half()
    assert h.get_num_new_matched_tokens(make_request("d1", 40, d_params(num_tokens=32)), 0) == (32, True)
    assert h.get_num_new_matched_tokens(make_request("d2", 40, d_params(num_tokens=32)), 32) == (0, False)


def test_a_decode_loads_the_kv_only_under_the_prompt_it_belongs_to() -> None:
    """The prefill's digest of its prompt ids travels with the KV (`connector.blocks.prompt_digest`)."""
    h = half()
    digest = prompt_digest(make_request("p", 40, None).prompt_token_ids, 40)
    same = make_request("d1", 40, d_params(num_tokens=40, remote_prompt_digest=digest))
    assert h.get_num_new_matched_tokens(same, 0) == (40, True)
    # A prompt that continues after the prefill's (its first output token, router/first_token.py).
    longer = make_request("d2", 41, d_params(num_tokens=40, remote_prompt_digest=digest))
    assert h.get_num_new_matched_tokens(longer, 0) == (40, True)
    # Another prompt (one token differs) must not take these keys and values: computed here instead.
    other = make_request("d3", 40, d_params("t-3", num_tokens=40, remote_prompt_digest=digest))
    other.prompt_token_ids[7] += 1
    assert h.get_num_new_matched_tokens(other, 0) == (0, False)
    assert h.get_num_new_matched_tokens(other, 0) == (0, False) and h.take_commands() == []  # asked again
    h.update_state_after_alloc(other, make_blocks([1, 2]), 0, now=0.0)
    assert h.take_commands() == [Abort("t-3", "the decode's prompt differs from the one the prefill computed")]
    assert h.counters["prompt_mismatch"] == 1 and h.counters["recv_released"] == 0
    # A prefill that sent no digest (a simulator, an older connector) is taken at its word.
    assert h.get_num_new_matched_tokens(make_request("d4", 40, d_params(num_tokens=40)), 0) == (40, True)


def test_requests_without_remote_prefill_load_nothing() -> None:
    h = half()
    assert h.get_num_new_matched_tokens(make_request("x", 40, None), 0) == (0, False)
    assert h.get_num_new_matched_tokens(make_request("p", 40, p_params()), 0) == (0, False)


@pytest.mark.parametrize("flag", ["false", "true", 1])
def test_a_do_remote_prefill_that_is_not_a_boolean_loads_nothing(flag: Any) -> None:
    h = half()
    req = make_request("d1", 40, d_params() | {"do_remote_prefill": flag})
    assert h.get_num_new_matched_tokens(req, 0) == (0, False)
    h.update_state_after_alloc(req, make_blocks([4, 5]), 0, now=0.0)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [4, 5], now=0.0) == (False, None)
    assert h.take_commands() == [] and h.build([], now=0.0).recv_done == ()
    assert h.counters["bad_params"] == 1


def test_bad_decode_params_still_take_the_async_path_and_fail_visibly() -> None:
    h = half()
    req = make_request("d1", 40, {"do_remote_prefill": True, "transfer_id": "bad id"})
    assert h.get_num_new_matched_tokens(req, 0) == (40, True)
    h.update_state_after_alloc(req, make_blocks([4, 5]), 40, now=0.0)
    step = h.build([], now=0.0)
    assert step.recv_done == (RecvDone("d1", False, (4, 5)),)
    assert h.counters["bad_params"] == 1 and h.counters["recv_failed"] == 1
    assert h.take_commands() == []  # no transfer id: nothing to abort


# ---- decode: the happy path ---------------------------------------------------------------------


def test_decode_claims_plans_pulls_and_reports_without_waiting_for_done() -> None:
    h = half()
    req = make_request("d1", 70, d_params("t-1", num_tokens=70))
    n, _ = h.get_num_new_matched_tokens(req, 32)
    assert n == 38
    # Block table: one local prefix-cache hit (block 11), then two fresh blocks for the load.
    h.update_state_after_alloc(req, make_blocks([11, 12, 13], cached=1), n, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    assert h.build([], now=0.1).pulls == ()  # nothing to pull before the claim answered

    h.on_result(Claimed("t-1", handoff("t-1", [40, 41, 42], num_tokens=70)), now=0.2)
    step = h.build([], now=0.2)
    (plan,) = step.pulls
    assert (plan.req_id, plan.transfer_id, plan.kv_key) == ("d1", "t-1", 9)
    assert plan.remote_block_ids == (41, 42) and plan.local_block_ids == (12, 13)  # the cached one is skipped
    assert plan.sources == ({"kind": "nixl", "agent_name": "p-tp0"},)

    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nbytes=4096, nblocks=2)], now=0.3)
    # Pulled well within the claim lease: the prefill held the blocks throughout (scheduler.py), so the
    # load is reported at once and DONE is recorded behind it.
    assert h.take_commands() == [Done("t-1")]
    assert h.build([], now=0.3).recv_done == (RecvDone("d1", True),)
    h.on_result(DoneResult("t-1", False, Code.HANDOFF_TERMINAL, "late"), now=0.4)  # too late to matter: ignored
    assert h.build([], now=0.4).recv_done == ()
    c = h.counters
    assert (c["recv_ok"], c["tokens_loaded"], c["blocks_pulled"], c["bytes_pulled"]) == (1, 38, 2, 4096)
    assert c["recv_failed"] == 0


def test_a_pull_that_ends_late_in_the_claim_lease_waits_for_done() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.1)
    assert len(h.build([], now=0.1).pulls) == 1
    # The handoff's claim lease is 30 s; past half of it the record may have lapsed: ask the ledger.
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=15.5)
    assert h.take_commands() == [Done("t-1")]
    assert h.build([], now=15.6).recv_done == ()  # not reported before the ledger confirmed
    h.on_result(DoneResult("t-1", True), now=15.7)
    assert h.build([], now=15.7).recv_done == (RecvDone("d1", True),)


def test_preempted_decode_does_not_pull_twice() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    # vLLM calls update_state_after_alloc again after the load, and after a preemption the request is
    # admitted afresh: neither may start a second transfer.
    h.update_state_after_alloc(req, make_blocks([1, 2, 3]), 0, now=1.0)
    assert h.get_num_new_matched_tokens(req, 0) == (0, False)
    assert h.take_commands() == []


def test_decode_needs_every_worker_before_confirming() -> None:
    h = half(world_size=2, tp_size=2)
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40, tp_size=2)), now=0.0)
    (plan,) = h.build([], now=0.0).pulls
    assert [s["agent_name"] for s in plan.sources] == ["p-tp0", "p-tp1"]
    h.take_commands()
    h.on_worker_output([PullOutcome("d1", "t-1", 1, True, nblocks=2)], now=0.0)
    assert h.take_commands() == []
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.0)
    assert h.take_commands() == [Done("t-1")]


# ---- decode: the early pull (from the params' location, while the claim is in flight) ------------


def test_early_pull_starts_before_the_claim_and_reports_once_claimed() -> None:
    h = half()
    req = make_request("d1", 40, early_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    (plan,) = h.build([], now=0.0).pulls
    assert (plan.kv_key, plan.remote_block_ids, plan.local_block_ids) == (9, (7, 8), (1, 2))
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.01)
    assert h.take_commands() == []
    assert h.build([], now=0.01).recv_done == ()  # pulled, but not yet ours: never used unclaimed
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.02)
    step = h.build([], now=0.02)
    assert step.pulls == ()  # the ledger agreed with the params: no second pull
    assert step.recv_done == (RecvDone("d1", True),)
    assert h.take_commands() == [Done("t-1")]
    assert h.counters["recv_ok"] == 1


def test_early_pull_claimed_before_it_finished_reports_when_it_does() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, early_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    assert len(h.build([], now=0.0).pulls) == 1
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.01)
    assert h.build([], now=0.01).recv_done == ()
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.02)
    assert h.build([], now=0.02).recv_done == (RecvDone("d1", True),)
    assert h.take_commands() == [Done("t-1")]


# ---- decode: the early pull, checked against the claim -------------------------------------------


def test_early_pull_from_a_location_the_ledger_contradicts_fails() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, early_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.01)
    h.on_result(Claimed("t-1", handoff("t-1", [17, 18], num_tokens=40)), now=0.02)
    step = h.build([], now=0.02)
    assert step.pulls == () and step.recv_done == (RecvDone("d1", False, (1, 2)),)
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and "pd_location_mismatch" in abort.reason


def test_early_pull_whose_claim_fails_is_a_load_error() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, early_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.01)
    h.on_result(ClaimFailed("t-1", Code.HANDOFF_TERMINAL, "handoff is ABORTED"), now=0.02)
    assert h.build([], now=0.02).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []
    assert h.counters["recv_ok"] == 0 and h.counters["recv_failed"] == 1


@pytest.mark.parametrize(
    "params",
    [
        early_params(location={"block_ids": "nope"}),  # unreadable: ignored
        early_params(location=handoff("t-1", [7, 8], num_tokens=40, block_size=16).location),  # unusable
        d_params("t-1", num_tokens=40, remote_location=handoff("t-1", [7], num_tokens=40).location.model_dump()),
    ],
    ids=["unreadable", "incompatible", "no-kv-key"],
)
def test_without_a_usable_params_location_the_pull_waits_for_the_claim(params: dict[str, Any]) -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, params), make_blocks([1, 2]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    assert h.build([], now=0.0).pulls == ()
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.01)
    assert len(h.build([], now=0.01).pulls) == 1


# ---- decode: failures ---------------------------------------------------------------------------


def _claimed(h: SchedulerHalf, blocks: list[int] | None = None, **loc: Any) -> None:
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks(blocks or [1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40, **loc)), now=0.0)


def test_failed_pull_reports_load_errors_and_aborts() -> None:
    h = half(world_size=2, tp_size=2)
    _claimed(h, tp_size=2)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 1, False, Code.TRANSPORT_PULL_TIMEOUT, "slow peer")], now=0.0)
    step = h.build([], now=1.0)
    assert step.recv_done == (RecvDone("d1", False, (1, 2)),)
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and abort.transfer_id == "t-1" and "transport_pull_timeout" in abort.reason
    assert h.counters["pulls_failed"] == 1 and h.counters["invalid_blocks"] == 2


@pytest.mark.parametrize(
    ("loc", "code"),
    [
        ({"block_size": 16}, "pd_location_mismatch: this decode has block_size 32, the prefill has 16"),
        ({"kv_layout": "LBHNC/float16/L2/H2/D32/B32"}, "pd_location_mismatch: this decode has kv_layout"),
        ({"tp_size": 2}, "pd_tp_layout_unsupported: this decode has tp 1, the prefill has tp 2 and its KV is not"),
        ({"addresses": []}, "no transport address"),
    ],
)
def test_incompatible_location_fails_with_the_reason(loc: dict[str, Any], code: str) -> None:
    h = half()
    _claimed(h, **loc)
    step = h.build([], now=0.0)
    assert step.pulls == () and step.recv_done == (RecvDone("d1", False, (1, 2)),)
    (abort,) = h.take_commands()
    assert code in abort.reason


def test_too_few_remote_blocks_fail() -> None:
    h = half()
    _claimed(h, blocks=[1, 2, 3])
    assert h.build([], now=0.0).recv_done == (RecvDone("d1", False, (1, 2, 3)),)


def test_claim_of_a_gone_handoff_fails_without_abort() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(ClaimFailed("t-1", Code.HANDOFF_TERMINAL, "handoff is EXPIRED"), now=0.0)
    assert h.build([], now=0.0).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []
    assert h.counters["claims_failed"] == 1


def test_claim_held_by_another_decode_fails_without_abort() -> None:
    # The other decode is reading the prefill's blocks: an abort from this one would free them under it.
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, d_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(ClaimFailed("t-1", Code.ILLEGAL_TRANSITION, "claimed by decode d-other"), now=0.0)
    assert h.build([], now=0.0).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []


def test_claim_that_timed_out_fails_and_aborts() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(ClaimFailed("t-1", Code.KV_NOT_READY, "not READY within 30s"), now=0.0)
    h.build([], now=0.0)
    assert [type(c) for c in h.take_commands()] == [Abort]


def test_ledger_refusing_done_means_the_kv_may_be_gone() -> None:
    h = half()
    _claimed(h)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=20.0)  # past half the lease
    h.take_commands()
    h.on_result(DoneResult("t-1", False, Code.HANDOFF_TERMINAL, "handoff is EXPIRED"), now=21.0)
    assert h.build([], now=21.0).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []  # already terminal: nothing to abort


def test_a_load_that_outlives_its_deadline_fails() -> None:
    h = half(ready_wait_s=5.0, pull_timeout_s=5.0, free_margin_s=1.0)
    _claimed(h)
    assert len(h.build([], now=0.0).pulls) == 1
    assert h.build([], now=10.9).recv_done == ()
    assert h.build([], now=11.0).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert [type(c) for c in h.take_commands()] == [Abort]
    # A late outcome for it is ignored.
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.0)
    assert h.take_commands() == [] and h.build([], now=12.0).recv_done == ()


def test_decode_aborted_before_it_was_scheduled_releases_the_prefill() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    finish(req, RequestStatus.FINISHED_ABORTED, computed=0)
    assert h.request_finished(req, [], now=0.0) == (False, None)
    (abort,) = h.take_commands()
    assert abort.transfer_id == "t-1" and "before" in abort.reason
    assert h.counters["recv_released"] == 1


def test_decode_with_nothing_to_load_releases_the_prefill() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2], cached=2), 0, now=0.0)
    (abort,) = h.take_commands()
    assert abort.transfer_id == "t-1" and "local prefix cache" in abort.reason
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [1, 2], now=1.0) == (False, None)
    assert h.take_commands() == []


def test_decode_aborted_while_loading_keeps_going_until_reported() -> None:
    h = half()
    _claimed(h)
    req = make_request("d1", 40, d_params())
    finish(req, RequestStatus.FINISHED_ABORTED, computed=40)
    assert h.request_finished(req, [1, 2], now=0.0) == (False, None)
    assert h.take_commands() == []
    # The pull still runs (vLLM keeps the blocks until finished_recving) and is confirmed as usual.
    assert len(h.build([], now=0.0).pulls) == 1


def test_load_counts_requests_and_waiting_loads() -> None:
    h = half()
    for rid in ("a", "b", "c"):
        h.on_new_request(make_request(rid, 8, None))
    h.update_state_after_alloc(make_request("d1", 40, d_params()), make_blocks([1, 2]), 40, now=0.0)
    load = h.load(0.25)
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, 0.25)


# ---- the idle step (workers may wait for a pull in it) -------------------------------------------


def test_only_a_step_that_computes_nothing_outside_data_parallelism_is_idle() -> None:
    assert idle_step(0, dp_size=1)
    assert not idle_step(1, dp_size=1)  # a batch computes: never hold it up for a pull
    assert not idle_step(0, dp_size=2)  # its peers step in lockstep (dummy batches): a wait holds them up


def test_the_step_metadata_says_whether_the_step_is_idle() -> None:
    h = half()
    assert h.build([], now=0.0, idle=True).idle
    assert not h.build([], now=0.0).idle

"""The decode side's siblings (vLLM's n > 1: one handoff, several decode requests; `siblings.py`): one
claim, one end after the last sibling settled; driven without I/O, as `test_scheduler_decode.py` says.
"""

from __future__ import annotations

from pdgate.connector.messages import (
    Abort,
    Claim,
    Claimed,
    Done,
)
from pdgate.connector.metadata import PullOutcome, RecvDone

from pdgate.errors import Code
from tests.unit.connector_vllm.conftest import make_blocks, make_request
from tests.unit.connector_vllm.scheduler_support import (
    d_params,
    half,
    handoff,
    router_params,
)

# ---- decode: siblings (vLLM's n > 1: one handoff, several decode requests) -----------------------


def test_siblings_under_the_routers_claim_each_pull_and_done_waits_for_the_last() -> None:
    h = half()
    params = router_params() | {"siblings": 2}
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    assert h.take_commands() == []
    plans = h.build([], now=0.0).pulls
    assert [(p.req_id, p.remote_block_ids, p.local_block_ids) for p in plans] == [
        ("0_d", (7, 8), (1, 2)),
        ("1_d", (7, 8), (3, 4)),
    ]
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.1)
    assert h.take_commands() == []  # the prefill must hold its blocks until the other sibling read them
    h.on_worker_output([PullOutcome("1_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.2)
    assert h.take_commands() == [Done("t-1")]
    assert h.counters["recv_ok"] == 2 and h.snapshot()["receiving"] == 0


def test_siblings_share_one_ledger_claim() -> None:
    h = half()
    params = d_params("t-1", num_tokens=40, siblings=2)
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]  # one claim for both
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.1)
    plans = h.build([], now=0.1).pulls
    assert sorted(p.local_block_ids for p in plans) == [(1, 2), (3, 4)]
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, True, nblocks=2)], now=0.2)
    assert h.build([], now=0.2).recv_done == (RecvDone("0_d", True),)
    assert h.take_commands() == []
    h.on_worker_output([PullOutcome("1_d", "t-1", 0, True, nblocks=2)], now=0.3)
    assert h.build([], now=0.3).recv_done == (RecvDone("1_d", True),)
    assert h.take_commands() == [Done("t-1")]


def test_a_sibling_joining_after_the_claim_pulls_where_it_says() -> None:
    h = half()
    params = d_params("t-1", num_tokens=40, siblings=2)
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.1)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.2)
    assert h.take_commands() == [Claim("t-1")]
    assert [p.local_block_ids for p in h.build([], now=0.2).pulls] == [(1, 2), (3, 4)]


def test_a_failed_sibling_does_not_abort_the_one_that_pulled() -> None:
    h = half()
    params = router_params() | {"siblings": 2}
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, False, Code.TRANSPORT_ERROR, "boom", reported=True)], now=0.1)
    assert h.take_commands() == []
    h.on_worker_output([PullOutcome("1_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.2)
    assert h.take_commands() == [Done("t-1")]
    assert (h.counters["recv_ok"], h.counters["recv_failed"]) == (1, 1)


def test_siblings_that_all_fail_abort_once() -> None:
    h = half()
    params = router_params() | {"siblings": 2}
    for i in range(2):
        h.update_state_after_alloc(make_request(f"{i}_d", 40, params), make_blocks([1 + 2 * i, 2 + 2 * i]), 40, now=0.0)
    h.build([], now=0.0)
    for i in range(2):
        h.on_worker_output([PullOutcome(f"{i}_d", "t-1", 0, False, Code.TRANSPORT_ERROR, "x", reported=True)], now=0.1)
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and abort.transfer_id == "t-1"


def test_a_sibling_that_ends_unscheduled_does_not_free_the_others_kv() -> None:
    h = half()
    params = router_params() | {"siblings": 2}
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.build([], now=0.0)
    assert h.request_finished(make_request("1_d", 40, params), [], now=0.05) == (False, None)  # never scheduled
    assert h.take_commands() == []
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.1)
    assert h.take_commands() == [Done("t-1")]


def test_a_sibling_that_reads_nothing_does_not_abort_the_handoff_another_one_reads() -> None:
    h = half()
    params = router_params() | {"siblings": 2}
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4], cached=2), 0, now=0.0)
    assert h.take_commands() == []  # the other sibling still reads the prefill's blocks
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.1)
    assert h.take_commands() == [Done("t-1")]  # the share completes: the prefill frees
    assert (h.counters["recv_ok"], h.counters["recv_released"]) == (1, 1)


def test_a_sibling_that_reads_nothing_first_leaves_the_claim_to_the_one_that_loads() -> None:
    h = half()
    params = d_params("t-1", num_tokens=40, siblings=2)
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2], cached=2), 0, now=0.0)
    assert h.take_commands() == []
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.1)
    (plan,) = h.build([], now=0.1).pulls
    h.on_worker_output([PullOutcome(plan.req_id, "t-1", 0, True, nblocks=2)], now=0.2)
    assert h.build([], now=0.2).recv_done == (RecvDone("1_d", True),)
    assert h.take_commands() == [Done("t-1")]


def test_siblings_that_all_read_nothing_release_the_prefill_once() -> None:
    h = half()
    params = d_params("t-1", num_tokens=40, siblings=2)
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2], cached=2), 0, now=0.0)
    assert h.take_commands() == []
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4], cached=2), 0, now=0.0)
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and abort.transfer_id == "t-1" and "local prefix cache" in abort.reason


def test_a_sibling_that_ends_before_the_others_are_scheduled_waits_for_them() -> None:
    h = half()
    params = d_params("t-1", num_tokens=40, siblings=2)
    assert h.request_finished(make_request("0_d", 40, params), [], now=0.0) == (False, None)
    assert h.take_commands() == []  # its sibling has yet to read the prefill's blocks
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    assert h.take_commands() == [Claim("t-1")]


def test_without_a_count_a_sibling_joins_while_the_others_load_and_a_late_one_fails() -> None:
    h = half()
    params = router_params()
    h.update_state_after_alloc(make_request("0_d", 40, params), make_blocks([1, 2]), 40, now=0.0)
    h.update_state_after_alloc(make_request("1_d", 40, params), make_blocks([3, 4]), 40, now=0.0)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("0_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.1)
    assert h.take_commands() == []  # the joined sibling still reads
    h.on_worker_output([PullOutcome("1_d", "t-1", 0, True, nblocks=2, reported=True)], now=0.2)
    assert h.take_commands() == [Done("t-1")]

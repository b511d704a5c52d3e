"""The scheduler half's bookkeeping, driven with vLLM's own Request and KV block objects.

No I/O: commands are read from `take_commands()` and the control thread's answers are fed back as the
result messages it would produce. `now` is passed explicitly, so leases and deadlines need no sleeping.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.messages import (
    Abort,
    Check,
    CheckResult,
    Claim,
    Claimed,
    ClaimFailed,
    Done,
    DoneResult,
    FeedStatus,
    MarkReady,
    ReadyFailed,
    ReadyRecorded,
    Terminal,
)
from pdgate.connector.metadata import PullOutcome, RecvDone
from pdgate.connector.scheduler import EngineFacts, SchedulerHalf
from pdgate.metaserver.models import Handoff, HandoffState, KVLocation, TransportAddress, TransportKind
from vllm.v1.request import RequestStatus

from tests.unit.connector_vllm.conftest import BLOCK_SIZE, make_blocks, make_request

LAYOUT = "LBHNC/bfloat16/L2/H2/D32/B32"


def cfg(**over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url="http://127.0.0.1:1",
        instance_id="node-a",
        url="http://127.0.0.1:8100",
        model="tiny",
        role="both",
        kv_lease_s=30.0,
        free_margin_s=10.0,
        ready_wait_s=30.0,
        pull_timeout_s=30.0,
    )
    base.update(over)
    return ConnectorConfig(**base)


def half(*, world_size: int = 1, tp_size: int = 1, replicated: bool = False, **over: Any) -> SchedulerHalf:
    facts = EngineFacts(
        instance_id="node-a",
        engine_id="engine-a",
        host="127.0.0.1",
        dp_rank=0,
        tp_size=tp_size,
        world_size=world_size,
        block_size=BLOCK_SIZE,
        kv_dtype="bfloat16",
        kv_layout=LAYOUT,
        kv_replicated=replicated,
        transport="nixl",
    )
    h = SchedulerHalf(cfg(**over), facts)
    h.set_addresses(
        {r: {"kind": "nixl", "agent_name": f"a-tp{r}", "agent_metadata": "QQ==", "regions": []} for r in range(tp_size)}
    )
    return h


def d_params(tid: str = "t-1", num_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid}
    if num_tokens is not None:
        p["remote_num_tokens"] = num_tokens
    p.update(extra)
    return p


def p_params(tid: str = "t-1", kv_key: int | None = 5) -> dict[str, Any]:
    p: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    if kv_key is not None:
        p["kv_key"] = kv_key
    return p


def handoff(tid: str, block_ids: list[int], *, num_tokens: int, tp_size: int = 1, **loc: Any) -> Handoff:
    location = KVLocation(
        block_ids=[block_ids],
        num_tokens=num_tokens,
        engine_id="engine-p",
        tp_size=tp_size,
        block_size=loc.pop("block_size", BLOCK_SIZE),
        kv_dtype="bfloat16",
        kv_layout=loc.pop("kv_layout", LAYOUT),
        transport=TransportKind.NIXL,
        transport_addresses=loc.pop(
            "addresses",
            [TransportAddress(tp_rank=r, meta={"kind": "nixl", "agent_name": f"p-tp{r}"}) for r in range(tp_size)],
        ),
    )
    return Handoff(
        transfer_id=tid,
        kv_key=9,
        state=HandoffState.CLAIMED,
        prefill_instance_id="p0",
        decode_instance_id="node-a",
        location=location,
        created_at=0.0,
        updated_at=0.0,
        lease_s=30.0,
    )


def finish(req: Any, status: RequestStatus, computed: int | None = None) -> None:
    req.status = status
    req.num_computed_tokens = req.num_prompt_tokens if computed is None else computed


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


def test_requests_without_remote_prefill_load_nothing() -> None:
    h = half()
    assert h.get_num_new_matched_tokens(make_request("x", 40, None), 0) == (0, False)
    assert h.get_num_new_matched_tokens(make_request("p", 40, p_params()), 0) == (0, False)


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
    h.on_result(DoneResult("t-1", False, "gone", "late"), now=0.4)  # too late to matter: ignored
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


def _early_params(tid: str = "t-1", location: Any = None, **extra: Any) -> dict[str, Any]:
    loc = location if location is not None else handoff(tid, [7, 8], num_tokens=40).location
    dumped = loc.model_dump(mode="json", exclude_none=True) if isinstance(loc, KVLocation) else loc
    return d_params(tid, num_tokens=40, kv_key=9, remote_location=dumped, **extra)


def test_early_pull_starts_before_the_claim_and_reports_once_claimed() -> None:
    h = half()
    req = make_request("d1", 40, _early_params())
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
    h.update_state_after_alloc(make_request("d1", 40, _early_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    assert len(h.build([], now=0.0).pulls) == 1
    h.on_result(Claimed("t-1", handoff("t-1", [7, 8], num_tokens=40)), now=0.01)
    assert h.build([], now=0.01).recv_done == ()
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.02)
    assert h.build([], now=0.02).recv_done == (RecvDone("d1", True),)
    assert h.take_commands() == [Done("t-1")]


def test_early_pull_from_a_location_the_ledger_contradicts_fails() -> None:
    h = half()
    h.update_state_after_alloc(make_request("d1", 40, _early_params()), make_blocks([1, 2]), 40, now=0.0)
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
    h.update_state_after_alloc(make_request("d1", 40, _early_params()), make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=0.01)
    h.on_result(ClaimFailed("t-1", "gone", "handoff is ABORTED"), now=0.02)
    assert h.build([], now=0.02).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []
    assert h.counters["recv_ok"] == 0 and h.counters["recv_failed"] == 1


@pytest.mark.parametrize(
    "params",
    [
        _early_params(location={"block_ids": "nope"}),  # unreadable: ignored
        _early_params(location=handoff("t-1", [7, 8], num_tokens=40, block_size=16).location),  # unusable
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
    h.on_worker_output([PullOutcome("d1", "t-1", 1, False, "transport_pull_timeout", "slow peer")], now=0.0)
    step = h.build([], now=1.0)
    assert step.recv_done == (RecvDone("d1", False, (1, 2)),)
    (abort,) = h.take_commands()
    assert isinstance(abort, Abort) and abort.transfer_id == "t-1" and "transport_pull_timeout" in abort.reason
    assert h.counters["pulls_failed"] == 1 and h.counters["invalid_blocks"] == 2


@pytest.mark.parametrize(
    ("loc", "code"),
    [
        ({"block_size": 16}, "block size"),
        ({"kv_layout": "LBHNC/float16/L2/H2/D32/B32"}, "KV layout"),
        ({"tp_size": 2}, "replicated"),
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
    h.on_result(ClaimFailed("t-1", "gone", "handoff is EXPIRED"), now=0.0)
    assert h.build([], now=0.0).recv_done == (RecvDone("d1", False, (1, 2)),)
    assert h.take_commands() == []
    assert h.counters["claims_failed"] == 1


def test_claim_that_timed_out_fails_and_aborts() -> None:
    h = half()
    req = make_request("d1", 40, d_params())
    h.update_state_after_alloc(req, make_blocks([1, 2]), 40, now=0.0)
    h.take_commands()
    h.on_result(ClaimFailed("t-1", "pd_kv_not_ready", "not READY within 30s"), now=0.0)
    h.build([], now=0.0)
    assert [type(c) for c in h.take_commands()] == [Abort]


def test_ledger_refusing_done_means_the_kv_may_be_gone() -> None:
    h = half()
    _claimed(h)
    h.build([], now=0.0)
    h.on_worker_output([PullOutcome("d1", "t-1", 0, True, nblocks=2)], now=20.0)  # past half the lease
    h.take_commands()
    h.on_result(DoneResult("t-1", False, "gone", "handoff is EXPIRED"), now=21.0)
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


# ---- prefill ------------------------------------------------------------------------------------


def test_finished_prefill_is_held_and_answers_with_the_location() -> None:
    h = half()
    req = make_request("p1", 70, p_params("t-7", kv_key=5), max_tokens=1)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    keep, params = h.request_finished(req, [4, 5, 6], now=0.0)
    assert keep is True
    assert params == {
        "transfer_id": "t-7",
        "kv_key": 5,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6],
        "remote_engine_id": "engine-a",
        "remote_num_tokens": 70,
        "remote_request_id": "p1",
        "prefill_instance_id": "node-a",
        "remote_location": params["remote_location"],
    }
    (cmd,) = h.take_commands()
    assert isinstance(cmd, MarkReady) and cmd.transfer_id == "t-7"
    loc = cmd.location
    # The params carry the READY record itself (for the decode's early pull), as JSON.
    assert KVLocation.model_validate(params["remote_location"]) == loc
    json.dumps(params)
    assert (loc.block_ids, loc.num_tokens, loc.block_size, loc.kv_layout) == ([[4, 5, 6]], 70, BLOCK_SIZE, LAYOUT)
    assert loc.transport_addresses[0].meta["agent_name"] == "a-tp0"
    assert h.build(["p1"], now=0.0).holds == ("p1",)
    assert h.has_holds()


def test_stopped_prefill_is_held_too_and_extra_blocks_are_not_advertised() -> None:
    h = half()
    req = make_request("p1", 64, p_params(), max_tokens=1)
    finish(req, RequestStatus.FINISHED_STOPPED, computed=65)  # one token computed past the prompt
    keep, params = h.request_finished(req, [1, 2, 3], now=0.0)
    assert keep and params is not None
    assert params["remote_block_ids"] == [1, 2] and params["remote_num_tokens"] == 64


@pytest.mark.parametrize(
    ("status", "blocks", "params"),
    [
        (RequestStatus.FINISHED_ABORTED, [1, 2], p_params()),
        (RequestStatus.FINISHED_ERROR, [1, 2], p_params()),
        (RequestStatus.FINISHED_LENGTH_CAPPED, [], p_params()),
        (RequestStatus.FINISHED_LENGTH_CAPPED, [1, 2], {"do_remote_decode": True}),
    ],
)
def test_prefill_without_kv_to_keep_frees_at_once(
    status: RequestStatus, blocks: list[int], params: dict[str, Any]
) -> None:
    h = half()
    req = make_request("p1", 40, params, max_tokens=1)
    finish(req, status)
    assert h.request_finished(req, blocks, now=0.0) == (False, None)
    assert h.take_commands() == [] and not h.has_holds()
    assert h.counters["prefill_not_kept"] == 1


def _held(h: SchedulerHalf, tid: str = "t-1", rid: str = "p1", now: float = 0.0) -> None:
    req = make_request(rid, 40, p_params(tid), max_tokens=1)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [1, 2], now=now)[0]
    h.take_commands()


def test_prefill_blocks_are_freed_only_when_the_ledger_says_done() -> None:
    h = half()
    _held(h)
    h.on_result(ReadyRecorded("t-1", 5, 30.0), now=0.0)
    assert h.build(["p1"], now=1.0).frees == ()
    h.on_result(Terminal("t-1", "DONE"), now=2.0)
    assert h.build([], now=2.0).frees == ("p1",)
    assert h.build([], now=3.0).frees == ()  # exactly once
    assert not h.has_holds()
    assert h.counters["sends_freed_done"] == 1


def test_a_free_waits_until_vllm_announced_the_request_finished() -> None:
    h = half()
    _held(h)
    h.on_result(Terminal("t-1", "ABORTED"), now=0.0)
    assert h.build([], now=0.0).frees == ()  # vLLM has not listed p1 in finished_req_ids yet
    assert h.build(["p1"], now=0.1).frees == ("p1",)
    assert h.counters["sends_freed_aborted"] == 1


def test_events_for_unknown_transfers_are_ignored() -> None:
    h = half()
    _held(h)
    h.on_result(Terminal("t-other", "DONE"), now=0.0)
    assert h.build(["p1"], now=0.0).frees == ()


def test_refused_ready_frees_at_once() -> None:
    h = half()
    _held(h)
    h.on_result(ReadyFailed("t-1", "gone", "handoff is ABORTED", terminal=True), now=0.0)
    assert h.build(["p1"], now=0.0).frees == ("p1",)
    assert h.counters["sends_freed_ready_failed"] == 1


def test_lease_expiry_while_the_metaserver_is_unreachable_frees_locally() -> None:
    h = half(kv_lease_s=30.0, free_margin_s=10.0)
    h.on_result(FeedStatus(True, 0.0), now=0.0)
    _held(h, now=1.0)
    h.on_result(ReadyFailed("t-1", "unavailable", "metaserver unreachable", terminal=False), now=31.0)
    assert h.build(["p1"], now=40.9).frees == ()
    # 40 s (lease + margin) after both the hold and the last word from the metaserver: free locally.
    assert h.build([], now=41.1).frees == ("p1",)
    assert h.counters["sends_freed_local_deadline"] == 1


def test_lease_overrun_with_a_live_metaserver_asks_instead_of_freeing() -> None:
    h = half(kv_lease_s=30.0, free_margin_s=10.0)
    _held(h, now=0.0)
    h.on_result(FeedStatus(True, 41.0), now=41.0)
    assert h.build(["p1"], now=41.0).frees == ()
    assert h.take_commands() == [Check("t-1")]
    assert h.build([], now=50.0).frees == () and h.take_commands() == []  # next check one lease later
    h.on_result(CheckResult("t-1", HandoffState.CLAIMED), now=50.0)
    assert h.build([], now=50.0).frees == ()
    h.on_result(CheckResult("t-1", None, found=False), now=51.0)
    assert h.build([], now=51.0).frees == ("p1",)
    assert h.counters["sends_freed_not_found"] == 1


def test_a_second_prefill_with_the_same_transfer_is_not_held() -> None:
    h = half()
    _held(h, rid="p1")
    req = make_request("p2", 40, p_params("t-1"), max_tokens=1)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [3], now=0.0) == (False, None)


def test_load_counts_requests_and_waiting_loads() -> None:
    h = half()
    for rid in ("a", "b", "c"):
        h.on_new_request(make_request(rid, 8, None))
    h.update_state_after_alloc(make_request("d1", 40, d_params()), make_blocks([1, 2]), 40, now=0.0)
    load = h.load(0.25)
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, 0.25)

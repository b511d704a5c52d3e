"""The scheduler half's prefill side (`scheduler_prefill.py`), driven with vLLM's own Request objects.

No I/O: commands are read from `take_commands()` and the control thread's answers are fed back as the
result messages it would produce. `now` is passed explicitly, so leases and deadlines need no sleeping.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdgate.connector.blocks import prompt_digest
from pdgate.connector.messages import (
    Check,
    CheckResult,
    FeedStatus,
    MarkReady,
    ReadyFailed,
    ReadyRecorded,
    Terminal,
)
from pdgate.connector.scheduler import SchedulerHalf
from vllm.v1.request import RequestStatus

from pdgate.errors import Code
from pdgate.models import HandoffState, KVLocation
from tests.unit.connector_vllm.conftest import BLOCK_SIZE, make_request
from tests.unit.connector_vllm.scheduler_support import LAYOUT, finish, half, p_params

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
        "remote_prompt_digest": prompt_digest(req.prompt_token_ids, 70),  # of the ids the KV belongs to
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


@pytest.mark.parametrize("flag", ["false", "true", 1, [True]])
def test_a_do_remote_decode_that_is_not_a_boolean_keeps_nothing(flag: Any) -> None:
    h = half()
    req = make_request("p1", 70, p_params("t-7") | {"do_remote_decode": flag}, max_tokens=1)
    finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.request_finished(req, [4, 5, 6], now=0.0) == (False, None)  # the contract refuses it: not true
    assert h.take_commands() == [] and not h.has_holds()
    # Refused as a flag, not read as a prefill's request that kept nothing.
    assert (h.counters["bad_params"], h.counters.get("prefill_not_kept", 0)) == (1, 0)


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
    h.on_result(ReadyFailed("t-1", Code.HANDOFF_TERMINAL, "handoff is ABORTED", terminal=True), now=0.0)
    assert h.build(["p1"], now=0.0).frees == ("p1",)
    assert h.counters["sends_freed_ready_failed"] == 1


def test_lease_expiry_while_the_metaserver_is_unreachable_frees_locally() -> None:
    h = half(kv_lease_s=30.0, free_margin_s=10.0)
    h.on_result(FeedStatus(True, 0.0), now=0.0)
    _held(h, now=1.0)
    h.on_result(ReadyFailed("t-1", Code.METASERVER_UNAVAILABLE, "metaserver unreachable", terminal=False), now=31.0)
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

"""pdgate.connector.metadata: typed kv_transfer_params, the per-step metadata, transport addresses."""

from __future__ import annotations

import pickle

import pytest
from pdgate.connector.metadata import (
    DecodeParams,
    InvalidTransferParams,
    PrefillParams,
    PullOutcome,
    RecvDone,
    RecvPlan,
    StepMetadata,
    address_from_model,
    address_to_model,
    prefill_result_params,
)


def test_prefill_params() -> None:
    assert PrefillParams.parse({"do_remote_decode": True, "transfer_id": "t-1", "kv_key": 7}) == PrefillParams("t-1", 7)
    assert PrefillParams.parse({"do_remote_decode": True, "transfer_id": "t-1"}).kv_key is None


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"transfer_id": ""},
        {"transfer_id": "has space"},
        {"transfer_id": 5},
        {"transfer_id": "t", "kv_key": 0},
        {"transfer_id": "t", "kv_key": True},
        {"transfer_id": "t", "kv_key": "7"},
    ],
)
def test_prefill_params_refused(params: dict[str, object]) -> None:
    with pytest.raises(InvalidTransferParams):
        PrefillParams.parse(params)


def test_decode_params_round_trip_the_prefill_answer() -> None:
    out = prefill_result_params(
        transfer_id="t-9",
        kv_key=42,
        block_ids=[3, 4],
        num_tokens=40,
        engine_id="e0",
        prefill_instance_id="p0",
        remote_request_id="cmpl-x-0-abcd",
    )
    assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
    assert DecodeParams.parse(out) == DecodeParams("t-9", 42, 40, (3, 4), "p0")


def test_decode_params_accept_nixl_style_group_nesting_and_absent_fields() -> None:
    assert DecodeParams.parse({"transfer_id": "t", "remote_block_ids": [[1, 2]]}).remote_block_ids == (1, 2)
    assert DecodeParams.parse({"transfer_id": "t"}) == DecodeParams("t")


@pytest.mark.parametrize(
    "params",
    [
        {"transfer_id": "t", "remote_block_ids": [1, -1]},
        {"transfer_id": "t", "remote_block_ids": "1,2"},
        {"transfer_id": "t", "remote_num_tokens": -1},
        {"transfer_id": "t", "prefill_instance_id": "a b"},
        {"remote_block_ids": [1]},
    ],
)
def test_decode_params_refused(params: dict[str, object]) -> None:
    with pytest.raises(InvalidTransferParams):
        DecodeParams.parse(params)


def test_prefill_answer_without_kv_key_leaves_it_out() -> None:
    out = prefill_result_params(
        transfer_id="t",
        kv_key=None,
        block_ids=[1],
        num_tokens=1,
        engine_id=None,
        prefill_instance_id="p",
        remote_request_id="r",
    )
    assert "kv_key" not in out


def test_nixl_address_travels_verbatim() -> None:
    addr = {"kind": "nixl", "agent_name": "p0-tp1", "agent_metadata": "AAAA", "regions": [{"name": "l0"}]}
    model = address_to_model(1, addr)
    assert model.tp_rank == 1 and model.host is None
    assert address_from_model(model) == addr


def test_llmdatadist_address_fills_the_device_fields() -> None:
    addr = {"kind": "llmdatadist", "cluster_id": 3, "device_id": 1, "device_ip": "10.0.0.9", "listen_port": 26000}
    model = address_to_model(0, addr)
    assert (model.cluster_id, model.device_id, model.device_ip) == (3, 1, "10.0.0.9")
    assert address_from_model(model) == addr


def test_step_metadata_pickles_and_knows_when_it_is_empty() -> None:
    assert StepMetadata().is_empty()
    step = StepMetadata(
        pulls=(RecvPlan("r1", "t1", 5, (7, 8), (1, 2), ({"kind": "nixl", "agent_name": "a"},)),),
        recv_done=(RecvDone("r0", False, (3,)),),
        holds=("p1",),
        frees=("p0",),
    )
    assert not step.is_empty()
    assert pickle.loads(pickle.dumps(step)) == step
    oc = PullOutcome("r1", "t1", 0, False, "transport_pull_timeout", "slow")
    assert pickle.loads(pickle.dumps(oc)) == oc

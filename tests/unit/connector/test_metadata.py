"""pdgate.connector.metadata: the per-step metadata, pull outcomes, transport addresses.

(The typed kv_transfer_params are pdgate.contract's: tests/unit/pairing_rules.)"""

from __future__ import annotations

import pickle

from pdgate.connector.metadata import (
    PullOutcome,
    RecvDone,
    RecvPlan,
    StepMetadata,
    address_from_model,
    address_to_model,
)

from pdgate.errors import Code


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
    oc = PullOutcome("r1", "t1", 0, False, Code.TRANSPORT_PULL_TIMEOUT, "slow")
    assert pickle.loads(pickle.dumps(oc)) == oc

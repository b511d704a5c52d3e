"""pdgate.connector.transport.factory: config -> transport, and llm_datadist workers placed without a rank table.

The fake llm_datadist (tests/fakes, CANN cannot run here) stands in for the real module under its import
name, so `make_transport` runs exactly as on an Ascend host: it finds each worker's device, builds the
transport, and the prefill's published address (carried as the ledger carries it: a `TransportAddress`
in a `KVLocation`, through JSON) is all the decode needs to link and pull real bytes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.devices import cluster_id_for_ip
from pdgate.connector.errors import ConfigError, DeviceNotFound
from pdgate.connector.location import EngineFacts, addresses_from_workers, location_for, plan_from_location
from pdgate.connector.ranktable import dump_rank_table
from pdgate.connector.ranktable_cli import generate, parse_host_spec
from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult
from pdgate.connector.transport.factory import make_transport
from pdgate.connector.transport.llmdatadist import LLMDataDistTransport

from pdgate.models import Handoff, HandoffState
from tests.fakes import fake_llmdatadist as fake

NUM_BLOCKS = 32
BLOCK_LEN = 512
NAMES = ("l0.k", "l0.v", "l1.k", "l1.v")


@pytest.fixture(autouse=True)
def fake_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    fake.reset()
    monkeypatch.setitem(sys.modules, "llm_datadist", fake)
    yield
    fake.reset()


def cfg(role: str, **over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url="http://m:1",
        instance_id=f"{role}-0",
        url=f"http://{role}:1",
        model="m",
        role=role,
        transport="llmdatadist",
        hccn_conf="/nonexistent/hccn.conf",
    )
    return ConnectorConfig(**(base | over))


def facts(tp_size: int = 1) -> EngineFacts:
    return EngineFacts("p", "p", "10.0.0.1", 0, tp_size, tp_size, 16, "bfloat16", "L", False, "llmdatadist")


class Rank:
    def __init__(self, transport: LLMDataDistTransport, seed: int | None) -> None:
        rng = np.random.default_rng(seed)
        self.bufs = [
            rng.integers(0, 256, NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8)
            if seed is not None
            else np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8)
            for _ in NAMES
        ]
        self.t = transport
        transport.register(
            [KVRegion.dense(n, b.ctypes.data, BLOCK_LEN, NUM_BLOCKS) for n, b in zip(NAMES, self.bufs, strict=True)]
        )

    def block(self, region: int, block: int) -> np.ndarray:
        return self.bufs[region].reshape(NUM_BLOCKS, BLOCK_LEN)[block]


def build(c: ConnectorConfig, seed: int | None = None, **kw: Any) -> Rank:
    kw = {"tp_rank": 0, "dp_rank": 0, "tp_size": 1, "env": {}} | kw
    t = make_transport(c, **kw)
    assert isinstance(t, LLMDataDistTransport)
    return Rank(t, seed)


def wait(rank: Rank) -> PullResult:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if results := rank.t.poll():
            return results[0]
        time.sleep(0.001)
    raise AssertionError("no pull result")


def test_registry_driven_prefill_and_decode_pull_real_bytes(tmp_path: Path) -> None:
    hccn = tmp_path / "hccn.conf"
    hccn.write_text("address_0=192.168.100.1\nnetmask_0=255.255.255.0\naddress_1=192.168.100.2\n")
    # The prefill reads its device IP from hccn.conf, the decode from $PDGATE_DEVICE_IP: no rank table.
    p = build(cfg("prefill", hccn_conf=str(hccn), transport_options={"listen_port": 26001}), seed=5)
    d = build(cfg("decode"), env={"PDGATE_DEVICE_IP": "192.168.200.1"})
    try:
        # What the prefill publishes in its registry record and its READY location ...
        (addr,) = addresses_from_workers({0: p.t.local_address()})
        assert (addr.device_id, addr.device_ip, addr.cluster_id) == (
            0,
            "192.168.100.1",
            cluster_id_for_ip("192.168.100.1"),
        )
        loc, kept = location_for(facts(), block_ids=[3, 4, 9], num_tokens=40, addresses=[addr], remote_request_id="r")
        handoff = Handoff(
            transfer_id="t1",
            kv_key=7,
            state=HandoffState.CLAIMED,
            prefill_instance_id="p",
            location=loc,
            created_at=0.0,
            updated_at=0.0,
            lease_s=30.0,
        )
        # ... travels through the ledger as JSON ...
        handoff = Handoff.model_validate(json.loads(handoff.model_dump_json()))
        # ... and is all the decode uses to link to the prefill's cluster and pull.
        plan = plan_from_location(handoff, facts(), req_id="d1", local_block_ids=[20, 21, 22], hit_blocks=0)
        assert plan.remote_block_ids == (3, 4, 9) and kept == [3, 4, 9]
        (source,) = plan.sources
        d.t.start_pull(PullRequest("t1", 7, source, plan.remote_block_ids, plan.local_block_ids))
        res = wait(d)
        assert res.ok, res.error
        for r in range(len(NAMES)):
            for s, dd in zip((3, 4, 9), (20, 21, 22), strict=True):
                np.testing.assert_array_equal(d.block(r, dd), p.block(r, s))
            assert not d.block(r, 23).any()
        link = next(c for c in fake.WORLD.calls if c[0] == "link_clusters")
        assert link == ("link_clusters", cluster_id_for_ip("192.168.200.1"), (cluster_id_for_ip("192.168.100.1"),))
    finally:
        p.t.close()
        d.t.close()


def test_tp_ranks_find_their_own_devices_through_visible_devices(tmp_path: Path) -> None:
    hccn = tmp_path / "hccn.conf"
    hccn.write_text("address_6=10.6.0.1\naddress_7=10.7.0.1\n")
    env = {"ASCEND_RT_VISIBLE_DEVICES": "6,7"}
    ranks = [build(cfg("prefill", hccn_conf=str(hccn)), tp_rank=i, tp_size=2, device_index=i, env=env) for i in (0, 1)]
    try:
        addrs = addresses_from_workers({i: r.t.local_address() for i, r in enumerate(ranks)})
        assert [(a.tp_rank, a.device_id, a.device_ip) for a in addrs] == [(0, 6, "10.6.0.1"), (1, 7, "10.7.0.1")]
        # llm_datadist is initialised on the device as the process sees it (npu:0, npu:1).
        options = [fake.WORLD.clusters[a.cluster_id].options["ge.exec.deviceId"] for a in addrs]
        assert options == ["0", "1"]
    finally:
        for r in ranks:
            r.t.close()


def test_two_ranks_with_one_cluster_id_are_refused() -> None:
    addr = {"kind": "llmdatadist", "cluster_id": 5, "device_ip": "10.0.0.5", "device_id": 0}
    with pytest.raises(ConfigError, match="tp ranks 0 and 1 share llm_datadist cluster id 5"):
        addresses_from_workers({0: addr, 1: addr | {"device_id": 1}})


def test_without_a_rank_table_or_device_addresses_the_transport_is_refused() -> None:
    with pytest.raises(DeviceNotFound) as err:
        make_transport(cfg("prefill"), tp_rank=0, dp_rank=0, tp_size=1, env={})
    assert "IP of NPU 0 is unknown" in str(err.value) and "PDGATE_DEVICE_IP" in str(err.value)
    with pytest.raises(ConfigError, match="kv_both"):
        make_transport(cfg("both"), tp_rank=0, dp_rank=0, tp_size=1, env={"PDGATE_DEVICE_IP": "10.0.0.1"})


def write_table(tmp_path: Path) -> Path:
    table = generate([parse_host_spec("10.1.0.1:2=192.168.1.3")], [parse_host_spec("10.1.0.2:192.168.2.1")])
    path = tmp_path / "rt.json"
    path.write_text(json.dumps(dump_rank_table(table)))
    return path


def test_a_rank_table_wins_over_device_discovery(tmp_path: Path) -> None:
    c = cfg("prefill", rank_table=str(write_table(tmp_path)), server_id="10.1.0.1", device_ips={2: "10.9.9.9"})
    p = build(c, seed=1, env={"PDGATE_DEVICE_IP": "10.8.8.8"})
    try:
        addr = p.t.local_address()
        assert (addr["cluster_id"], addr["device_id"], addr["device_ip"]) == (0, 2, "192.168.1.3")
        assert addr["server_id"] == "10.1.0.1"
    finally:
        p.t.close()


def test_a_rank_table_is_validated_against_the_worker(tmp_path: Path) -> None:
    path = write_table(tmp_path)
    with pytest.raises(ConfigError, match="needs server_id"):
        make_transport(cfg("prefill", rank_table=str(path)), tp_rank=0, dp_rank=0, tp_size=1, env={})
    # The table puts this prefill on device 2; its KV cache is on npu:0 = device 0.
    with pytest.raises(DeviceNotFound, match="on device 2, but its KV cache is on device 0"):
        make_transport(
            cfg("prefill", rank_table=str(path), server_id="10.1.0.1"),
            tp_rank=0,
            dp_rank=0,
            tp_size=1,
            device_index=0,
            env={},
        )

"""Mooncake's rules that need no engine: wheel -> protocol, one registration per contiguous extent, ranges
merged and capped per call, the config key, the factory, and the pairing rule (mooncake only with mooncake).

The engine is a stand-in here (``FakeEngine`` copies bytes with memmove in this process), so these run
without the wheel; the conformance suite runs the real one between processes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
import types
from typing import Any

import numpy as np
import pytest
from pdgate.connector.config import ServerFacts, parse_config
from pdgate.connector.errors import ConfigError
from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult, merge_extents
from pdgate.connector.transport.errors import InvalidPull
from pdgate.connector.transport.factory import make_transport
from pdgate.connector.transport.mooncake import MooncakeTransport, default_protocol

from pdgate.contract import KVFacts, mismatch
from pdgate.models import TransportKind


@pytest.fixture(autouse=True)
def _no_stall_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport writes MC_TCP_PROGRESS_TIMEOUT_SEC when unset; start each test without it and take
    what it wrote away afterwards (setenv first, so that the undo removes it)."""
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "0")
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC")


class FakeEngine:
    """What MooncakeTransport calls, recorded; reads are memmoves within this process."""

    ports = iter(range(20000, 21000))

    def __init__(self) -> None:
        self.registered: list[tuple[list[int], list[int]]] = []
        self.batches: list[int] = []
        self.init_args: tuple[Any, ...] = ()
        self.port = next(self.ports)

    def initialize(self, *args: Any) -> int:
        self.init_args = args
        return 0

    def get_rpc_port(self) -> int:
        return self.port

    def batch_register_memory(self, ptrs: list[int], lens: list[int]) -> int:
        self.registered.append((ptrs, lens))
        return 0

    def register_memory(self, ptr: int, n: int) -> int:
        self.registered.append(([ptr], [n]))
        return 0

    def unregister_memory(self, ptr: int) -> int:
        return 0

    def batch_transfer_sync_read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        self.batches.append(len(lens))
        for d, s, n in zip(local, remote, lens, strict=True):
            ctypes.memmove(d, s, n)
        return 0


def fake_module() -> Any:
    return types.SimpleNamespace(TransferEngine=FakeEngine)


def make(bufs: list[np.ndarray], block_len: int, **kw: Any) -> MooncakeTransport:
    t = MooncakeTransport(engine_module=fake_module(), protocol="tcp", **kw)
    n = len(bufs[0]) // block_len
    t.register([KVRegion.dense(f"r{i}", b.ctypes.data, block_len, n) for i, b in enumerate(bufs)])
    return t


def wait(t: MooncakeTransport) -> PullResult:
    for _ in range(5000):
        out = t.poll()
        if out:
            return out[0]
        time.sleep(0.001)
    raise AssertionError("no result")


def test_the_installed_wheel_names_the_protocol() -> None:
    assert default_protocol({"mooncake-transfer-engine-non-cuda"}) == "tcp"
    assert default_protocol({"mooncake_transfer_engine_npu"}) == "ascend"
    assert default_protocol({"mooncake-transfer-engine"}) == "rdma"
    assert default_protocol({"numpy"}) == "tcp"


def test_contiguous_regions_are_one_registration_and_gaps_stay_apart() -> None:
    regions = [KVRegion.dense(f"l{i}", 4096 + i * 1024, 256, 4) for i in range(8)]  # back to back
    assert merge_extents(regions) == [(4096, 8 * 1024)]
    gap = [KVRegion.dense("a", 4096, 256, 4), KVRegion.dense("b", 4096 + 2048, 256, 4)]
    assert merge_extents(gap) == [(4096, 1024), (4096 + 2048, 1024)]
    kv = [KVRegion("k", 4096, 256, 4, 512), KVRegion("v", 4096 + 256, 256, 4, 512)]  # interleaved views
    assert merge_extents(kv) == [(4096, 2048)]


def test_one_buffer_is_one_registration_and_ranges_merge_and_cap_at_the_batch_size() -> None:
    bl, n = 64, 4096
    whole = np.random.default_rng(1).integers(0, 256, 2 * n * bl, dtype=np.uint8)
    p = make([whole[: n * bl], whole[n * bl :]], bl)  # two regions, back to back: one extent
    dst_bufs = [np.zeros(n * bl, dtype=np.uint8) for _ in range(2)]
    d = make(dst_bufs, bl, max_batch=1000)
    engine = p._engine
    assert engine.registered[0] == ([whole.ctypes.data], [2 * n * bl])  # then the probe byte, apart
    assert engine.registered[1][1] == [64] and len(engine.registered) == 2
    # 100 adjacent blocks: one range per region.
    d.start_pull(PullRequest("run", 1, p.local_address(), list(range(100)), list(range(200, 300))))
    assert wait(d).ok and d._engine.batches == [2]
    # 1,500 scattered blocks x 2 regions = 3,000 ranges: 1000 + 1000 + 1000.
    rng = np.random.default_rng(2)
    src, dst = rng.permutation(n)[:1500].tolist(), rng.permutation(n)[:1500].tolist()
    d.start_pull(PullRequest("scatter", 2, p.local_address(), src, dst))
    res = wait(d)
    assert res.ok and res.nbytes == 3000 * bl
    assert d._engine.batches[1:] == [1000, 1000, 1000]
    for r in range(2):
        got, want = dst_bufs[r].reshape(n, bl), whole[r * n * bl : (r + 1) * n * bl].reshape(n, bl)
        np.testing.assert_array_equal(got[dst], want[src])
    d.close()
    p.close()


def test_a_peer_speaking_another_protocol_or_with_descriptors_outside_its_buffers_is_refused() -> None:
    bl = 64
    p = make([np.ones(64 * bl, dtype=np.uint8)], bl)
    d = make([np.zeros(64 * bl, dtype=np.uint8)], bl)
    addr = p.local_address()
    with pytest.raises(InvalidPull, match="speaks 'rdma'"):
        d.start_pull(PullRequest("x", 1, {**addr, "protocol": "rdma"}, [0], [0]))
    moved = [dict(r, base_ptr=r["base_ptr"] + (1 << 20)) for r in addr["regions"]]
    with pytest.raises(InvalidPull, match="outside its registered buffers"):
        d.start_pull(PullRequest("x", 1, {**addr, "regions": moved}, [0], [0]))
    with pytest.raises(InvalidPull, match="session"):
        d.start_pull(PullRequest("x", 1, {**addr, "session": "10.0.0.9:1"}, [0], [0]))
    d.close()
    p.close()


def test_the_config_key_and_the_factory() -> None:
    facts = ServerFacts(kv_role="kv_consumer", host="10.1.2.3", port=8100, served_model="m")
    base = {"metaserver_url": "http://ms:8300", "transport": "mooncake"}
    with pytest.raises(ConfigError, match="mooncake_protocol"):
        parse_config({**base, "mooncake_protocol": "udp"}, facts)
    cfg = parse_config(
        {**base, "mooncake_protocol": "rdma", "transport_options": {"engine_module": fake_module()}}, facts
    )
    t = make_transport(cfg, tp_rank=0, dp_rank=0, tp_size=1)
    try:
        assert isinstance(t, MooncakeTransport)
        assert t.protocol == "rdma" and t.session == f"10.1.2.3:{t.port}"
        assert t._engine.init_args == ("10.1.2.3", "P2PHANDSHAKE", "rdma", "")
        # The stall deadline follows the synchronous load's bound (5 s), not the pull's (30 s).
        assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "5"
    finally:
        t.close()


def test_mooncake_pairs_only_with_mooncake() -> None:
    moon = KVFacts(transport=TransportKind.MOONCAKE, tp_size=1)
    assert mismatch(moon, moon) is None
    for other in (TransportKind.NIXL, TransportKind.LLMDATADIST):
        refused = mismatch(moon, KVFacts(transport=other, tp_size=1))
        assert refused is not None and refused.field == "transport"
        assert mismatch(KVFacts(transport=other), moon) is not None
    # A one-sided read: a larger decode may read one replicated prefill rank (llm_datadist may not).
    prefill = KVFacts(transport=TransportKind.MOONCAKE, tp_size=1, kv_replicated=True)
    assert mismatch(prefill, dataclasses.replace(moon, tp_size=2)) is None

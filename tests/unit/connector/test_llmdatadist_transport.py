"""LLMDataDistTransport against the fake llm_datadist (CANN cannot run here).

P and D live in this process; the fake copies real bytes between their registered buffers.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pdgate.connector.ranktable import GroupRole, assign_ranks, find_placement
from pdgate.connector.ranktable_cli import generate, parse_host_spec
from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult
from pdgate.connector.transport.errors import (
    EngineError,
    InvalidPull,
    LinkError,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    RemoteKVMissing,
    TransportClosed,
)
from pdgate.connector.transport.llmdatadist import (
    MAX_CLUSTERS_PER_LINK_CALL,
    MAX_REGISTERED_ADDRS,
    LLMDataDistTransport,
    group_regions,
    map_status,
)

from tests.fakes import fake_llmdatadist as fake

NUM_BLOCKS = 64
BLOCK_LEN = 1024
NAMES = ("layer0.k", "layer0.v", "layer1.k", "layer1.v")


@pytest.fixture(autouse=True)
def fresh_world() -> Iterator[None]:
    fake.reset()
    yield
    fake.reset()


class Rank:
    """One transport plus the buffers behind its regions (kept alive here)."""

    def __init__(self, transport: LLMDataDistTransport, bufs: list[np.ndarray]) -> None:
        self.t = transport
        self.bufs = bufs

    def block(self, region: int, block: int) -> np.ndarray:
        return self.bufs[region].reshape(NUM_BLOCKS, BLOCK_LEN)[block]


@pytest.fixture
def make_rank() -> Iterator[Callable[..., Rank]]:
    ranks: list[Rank] = []

    def make(role: str, cluster_id: int, *, fill_seed: int | None = None, **kw) -> Rank:
        rng = np.random.default_rng(fill_seed)
        bufs = [
            rng.integers(0, 256, NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8)
            if fill_seed is not None
            else np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8)
            for _ in NAMES
        ]
        t = LLMDataDistTransport(
            role=role,
            cluster_id=cluster_id,
            device_id=cluster_id % 8,
            device_ip=f"10.0.{cluster_id // 250}.{cluster_id % 250 + 1}",
            llm_datadist=fake,
            **kw,
        )
        t.register([KVRegion.dense(n, b.ctypes.data, BLOCK_LEN, NUM_BLOCKS) for n, b in zip(NAMES, bufs, strict=True)])
        rank = Rank(t, bufs)
        ranks.append(rank)
        return rank

    yield make
    for rank in ranks:
        rank.t.close()


def wait_result(rank: Rank, bound_s: float = 5.0) -> PullResult:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        results = rank.t.poll()
        if results:
            assert len(results) == 1
            return results[0]
        time.sleep(0.001)
    raise AssertionError("no pull result")


def calls(method: str) -> list[tuple[str, int, tuple[int, ...]]]:
    return [c for c in fake.WORLD.calls if c[0] == method]


def test_pull_moves_the_requested_blocks_and_nothing_else(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=3)
    d = make_rank("decode", 2)
    rng = np.random.default_rng(9)
    src = rng.permutation(NUM_BLOCKS)[:20].tolist()
    dst = rng.permutation(NUM_BLOCKS)[:20].tolist()
    d.t.start_pull(PullRequest("t1", 2**63 + 5, p.t.local_address(), src, dst))
    res = wait_result(d)
    assert res.ok and res.error is None
    assert res.nbytes == 20 * BLOCK_LEN * len(NAMES)
    for r in range(len(NAMES)):
        for s, dd in zip(src, dst, strict=True):
            np.testing.assert_array_equal(d.block(r, dd), p.block(r, s))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
        assert not d.bufs[r].reshape(NUM_BLOCKS, BLOCK_LEN)[untouched].any()


def test_links_are_lazy_and_reused(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=3)
    d = make_rank("decode", 2)
    assert calls("link_clusters") == []  # nothing linked at construction or registration
    for i in range(3):
        d.t.start_pull(PullRequest(f"t{i}", i, p.t.local_address(), [i], [i]))
        assert wait_result(d).ok
    assert calls("link_clusters") == [("link_clusters", 2, (1,))]


def test_registration_groups_regions_by_block_len_into_model_ids() -> None:
    regions = [
        KVRegion.dense("a", 4096, 512, 8),
        KVRegion.dense("b", 8192, 256, 8),
        KVRegion.dense("c", 16384, 512, 8),
    ]
    assert group_regions(regions) == [[0, 2], [1]]


def test_timeout_breaks_the_link_and_the_next_pull_relinks(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    d.t.start_pull(PullRequest("warm", 1, p.t.local_address(), [0], [0]))
    assert wait_result(d).ok

    fake.WORLD.faults.timeout_next_pull(1)
    d.t.start_pull(PullRequest("slow", 2, p.t.local_address(), [1], [1]))
    res = wait_result(d)
    assert not res.ok and isinstance(res.error, PullTimeout)
    assert res.error.retryable and res.error.engine_code == "LLM_WAIT_PROCESS_TIMEOUT"
    assert calls("unlink_clusters") == [("unlink_clusters", 2, (1,))]

    d.t.start_pull(PullRequest("after", 3, p.t.local_address(), [5], [6]))
    res = wait_result(d)
    assert res.ok, res.error
    assert len(calls("link_clusters")) == 2  # rebuilt
    np.testing.assert_array_equal(d.block(0, 6), p.block(0, 5))


def test_a_poisoned_link_is_not_reused(make_rank) -> None:
    # Without the tear-down the fake answers LLM_LINK_FAILED on a poisoned link: prove the
    # transport does not get there by poisoning behind its back and checking the next outcome.
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    d.t.start_pull(PullRequest("warm", 1, p.t.local_address(), [0], [0]))
    assert wait_result(d).ok
    fake.WORLD.links[frozenset((1, 2))] = False
    d.t.start_pull(PullRequest("broken", 2, p.t.local_address(), [1], [1]))
    res = wait_result(d)
    assert isinstance(res.error, LinkError) and res.error.engine_code == "LLM_LINK_FAILED"
    d.t.start_pull(PullRequest("healed", 3, p.t.local_address(), [1], [1]))
    assert wait_result(d).ok


def test_link_failure_is_a_retryable_link_error(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    fake.WORLD.faults.fail_next_link(1)
    d.t.start_pull(PullRequest("x", 1, p.t.local_address(), [0], [0]))
    res = wait_result(d)
    assert isinstance(res.error, LinkError) and res.error.retryable
    assert res.error.code == "transport_link_failed"
    d.t.start_pull(PullRequest("y", 2, p.t.local_address(), [0], [0]))
    assert wait_result(d).ok


def test_wrong_listen_port_fails_to_link(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    addr = {**p.t.local_address(), "listen_port": 1234}
    d.t.start_pull(PullRequest("x", 1, addr, [0], [0]))
    assert isinstance(wait_result(d).error, LinkError)


def test_unknown_cache_key_is_remote_kv_missing(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    for cache in p.t._caches:  # the prefill rank lost its registration (e.g. restarted mid-way)
        p.t._cm.unregister_cache(cache.cache_id)
    d.t.start_pull(PullRequest("x", 1, p.t.local_address(), [0], [0]))
    res = wait_result(d)
    assert isinstance(res.error, RemoteKVMissing) and not res.error.retryable
    assert res.error.engine_code == "LLM_KV_CACHE_NOT_EXIST"


def test_dead_prefill_gives_link_error(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    d.t.start_pull(PullRequest("warm", 1, p.t.local_address(), [0], [0]))
    assert wait_result(d).ok
    address = p.t.local_address()
    p.t.close()
    d.t.start_pull(PullRequest("x", 2, address, [0], [0]))
    res = wait_result(d)
    assert isinstance(res.error, LinkError) and res.error.retryable


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        ("LLM_WAIT_PROCESS_TIMEOUT", PullTimeout),
        ("LLM_TIMEOUT", PullTimeout),
        ("LLM_KV_CACHE_NOT_EXIST", RemoteKVMissing),
        ("LLM_PARAM_INVALID", InvalidPull),
        ("LLM_CLUSTER_NUM_EXCEED_LIMIT", InvalidPull),
        ("LLM_NOT_YET_LINK", LinkError),
        ("LLM_LINK_FAILED", LinkError),
        ("LLM_LINK_BUSY", LinkError),
        ("LLM_PROCESSING_LINK", LinkError),
        ("LLM_SUSPECT_REMOTE_ERROR", PeerUnreachable),
        ("LLM_FAILED", EngineError),
        ("LLM_OUT_OF_MEMORY", EngineError),
    ],
)
def test_status_codes_map_to_typed_errors(status: str, cls: type) -> None:
    err = map_status(fake.LLMStatusCode[status], "boom")
    assert type(err) is cls
    assert err.engine_code == status
    assert status in str(err) and err.code in str(err)


@pytest.mark.parametrize("code", [fake.LLMStatusCode.LLM_OUT_OF_MEMORY, fake.LLMStatusCode.LLM_PARAM_INVALID])
def test_injected_pull_failures_arrive_typed(make_rank, code) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    fake.WORLD.faults.fail_next_pull(1, code)
    d.t.start_pull(PullRequest("x", 1, p.t.local_address(), [0], [0]))
    res = wait_result(d)
    assert type(res.error) is type(map_status(code, ""))
    assert not calls("unlink_clusters")  # not a link fault: the link stays


def test_prelink_caps_clusters_per_call(make_rank) -> None:
    prefills = [make_rank("prefill", 100 + i, fill_seed=i) for i in range(MAX_CLUSTERS_PER_LINK_CALL + 4)]
    d = make_rank("decode", 2)
    outcome = d.t.prelink([p.t.local_address() for p in prefills]).result(timeout=5)
    assert outcome == {100 + i: None for i in range(len(prefills))}
    sizes = [len(c[2]) for c in calls("link_clusters")]
    assert sizes == [MAX_CLUSTERS_PER_LINK_CALL, 4]
    d.t.start_pull(PullRequest("x", 1, prefills[-1].t.local_address(), [3], [4]))
    assert wait_result(d).ok
    assert len(calls("link_clusters")) == 2  # already linked: no new call
    np.testing.assert_array_equal(d.block(1, 4), prefills[-1].block(1, 3))


def test_the_fake_enforces_the_per_call_cap_like_the_library() -> None:
    dd = fake.LLMDataDist(fake.LLMRole.DECODER, 5)
    dd.init({"ge.exec.deviceId": "0", "llm.EnableCacheManager": "1"})
    infos = []
    for i in range(MAX_CLUSTERS_PER_LINK_CALL + 1):
        info = fake.LLMClusterInfo()
        info.remote_cluster_id = 1000 + i
        info.append_local_ip_info("10.0.0.1", 0)
        infos.append(info)
    ret, rets = dd.link_clusters(infos, timeout=100)
    assert ret == fake.LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT and rets == []
    dd.finalize()


def test_registered_address_cap_is_checked_before_the_library() -> None:
    t = LLMDataDistTransport(role="decode", cluster_id=9, device_id=0, device_ip="10.0.0.9", llm_datadist=fake)
    buf = np.zeros(BLOCK_LEN * 2 * (MAX_REGISTERED_ADDRS + 1), dtype=np.uint8)
    regions = [
        KVRegion.dense(f"r{i}", buf.ctypes.data + i * 2 * BLOCK_LEN, BLOCK_LEN, 2)
        for i in range(MAX_REGISTERED_ADDRS + 1)
    ]
    with pytest.raises(RegistrationError, match="240"):
        t.register(regions)
    t.register(regions[:MAX_REGISTERED_ADDRS])  # exactly at the limit is fine
    t.close()


def test_registration_errors(make_rank) -> None:
    t = LLMDataDistTransport(role="decode", cluster_id=9, device_id=0, device_ip="10.0.0.9", llm_datadist=fake)
    buf = np.zeros(BLOCK_LEN * 8, dtype=np.uint8)
    with pytest.raises(RegistrationError, match="before register"):
        t.local_address()
    with pytest.raises(RegistrationError, match="stride"):
        t.register([KVRegion("k", buf.ctypes.data, BLOCK_LEN, 4, 2 * BLOCK_LEN)])
    with pytest.raises(RegistrationError, match="num_blocks"):
        t.register(
            [KVRegion.dense("a", buf.ctypes.data, BLOCK_LEN, 4), KVRegion.dense("b", buf.ctypes.data, BLOCK_LEN, 3)]
        )
    t.register([KVRegion.dense("k", buf.ctypes.data, BLOCK_LEN, 8)])
    with pytest.raises(RegistrationError, match="already"):
        t.register([KVRegion.dense("k", buf.ctypes.data, BLOCK_LEN, 8)])
    t.close()


def test_bad_requests_fail_synchronously(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    addr = p.t.local_address()
    cases = [
        (PullRequest("a", 1, addr, [0, 1], [0]), "local_block_ids has 1"),
        (PullRequest("a", 1, addr, [NUM_BLOCKS], [0]), "out of range"),
        (PullRequest("a", 1, addr, [0, 1], [3, 3]), "appears twice"),
        (PullRequest("a", -1, addr, [0], [0]), "kv_key"),
        (PullRequest("a", 1, {**addr, "kind": "nixl"}, [0], [0]), "kind"),
        (PullRequest("a", 1, {**addr, "cluster_id": 2}, [0], [0]), "our own"),
        (PullRequest("a", 1, {**addr, "listen_port": None}, [0], [0]), "does not listen"),
        (PullRequest("a", 1, {**addr, "device_ip": "10.0.0"}, [0], [0]), "IPv4"),
        (PullRequest("a", 1, {**addr, "regions": addr["regions"][:2]}, [0], [0]), "2 regions"),
    ]
    for req, match in cases:
        with pytest.raises(InvalidPull, match=match):
            d.t.start_pull(req)
    assert d.t.poll() == []
    assert calls("link_clusters") == []


def test_request_that_waited_past_its_deadline_is_not_started(make_rank) -> None:
    now = [0.0]
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2, clock=lambda: now[0])
    gate = threading.Event()
    fake.WORLD.faults.gate = gate
    d.t.start_pull(PullRequest("first", 1, p.t.local_address(), [0], [0]))
    d.t.start_pull(PullRequest("queued", 2, p.t.local_address(), [1], [1], timeout_s=0.5))
    deadline = time.monotonic() + 5
    while not calls("pull_blocks") and time.monotonic() < deadline:  # "first" is inside pull_blocks
        time.sleep(0.001)
    now[0] = 2.0
    gate.set()
    results: dict[str, PullResult] = {}
    while len(results) < 2 and time.monotonic() < deadline:
        results.update({r.transfer_id: r for r in d.t.poll()})
        time.sleep(0.001)
    assert results["first"].ok
    assert isinstance(results["queued"].error, PullTimeout)
    assert "not started" in results["queued"].error.message
    assert not d.bufs[0].reshape(NUM_BLOCKS, BLOCK_LEN)[1].any()


def test_duplicate_transfer_id_while_in_flight(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    gate = threading.Event()
    fake.WORLD.faults.gate = gate
    d.t.start_pull(PullRequest("same", 1, p.t.local_address(), [0], [0]))
    with pytest.raises(InvalidPull, match="already in flight"):
        d.t.start_pull(PullRequest("same", 1, p.t.local_address(), [1], [1]))
    gate.set()
    assert wait_result(d).ok


def test_close_unlinks_finalizes_and_refuses_further_use(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4)
    d = make_rank("decode", 2)
    d.t.start_pull(PullRequest("x", 1, p.t.local_address(), [0], [0]))
    assert wait_result(d).ok
    d.t.close()
    assert calls("unlink_clusters") == [("unlink_clusters", 2, (1,))]
    assert 2 not in fake.WORLD.clusters
    with pytest.raises(TransportClosed):
        d.t.start_pull(PullRequest("y", 2, p.t.local_address(), [0], [0]))
    d.t.close()  # idempotent


def test_init_options_follow_the_documented_config(make_rank) -> None:
    p = make_rank("prefill", 1, fill_seed=4, sync_kv_timeout_ms=1234)
    d = make_rank("decode", 2)
    opts = fake.WORLD.clusters[1].options
    assert opts["ge.exec.deviceId"] == "1"
    assert opts["llm.SyncKvCacheWaitTime"] == "1234"
    assert opts["llm.EnableCacheManager"] == "1"
    assert opts["llm.EnableRemoteCacheAccessible"] == "1"
    assert opts["llm.listenIpInfo"] == f"{p.t.device_ip}:26000"
    assert "llm.listenIpInfo" not in fake.WORLD.clusters[2].options  # decode only pulls
    assert fake.WORLD.clusters[1].role == fake.LLMRole.PROMPT
    assert fake.WORLD.clusters[2].role == fake.LLMRole.DECODER
    assert d.t.local_address()["listen_port"] is None


def test_the_real_module_is_imported_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdgate.connector.transport.llmdatadist  # noqa: F401  (no llm_datadist needed to import)

    monkeypatch.setitem(sys.modules, "llm_datadist", None)  # as on a host without CANN
    with pytest.raises(ImportError):
        LLMDataDistTransport(role="decode", cluster_id=1, device_id=0, device_ip="10.0.0.1")


def test_rank_table_placements_build_linked_transports() -> None:
    table = generate(
        [parse_host_spec("10.1.0.1:192.168.1.1,192.168.1.2")], [parse_host_spec("10.1.0.2:192.168.2.1,192.168.2.2")]
    )
    placements = assign_ranks(table, prefill_tp=2, decode_tp=2)
    bufs = {p.cluster_id: np.full(NUM_BLOCKS * BLOCK_LEN, p.cluster_id + 1, dtype=np.uint8) for p in placements}
    ranks = {}
    for p in placements:
        t = LLMDataDistTransport(
            role=p.role.value,
            cluster_id=p.cluster_id,
            device_id=p.device_id,
            device_ip=p.device_ip,
            server_id=p.server_id,
            llm_datadist=fake,
        )
        t.register([KVRegion.dense("kv", bufs[p.cluster_id].ctypes.data, BLOCK_LEN, NUM_BLOCKS)])
        ranks[(p.role, p.tp_rank)] = t
    try:
        for tp in (0, 1):  # D rank tp pulls from the P rank with the same tp_rank
            d, p_addr = ranks[(GroupRole.DECODE, tp)], ranks[(GroupRole.PREFILL, tp)].local_address()
            assert p_addr["server_id"] == "10.1.0.1" and p_addr["listen_port"] == 26000
            d.start_pull(PullRequest(f"tp{tp}", tp, p_addr, [0], [1]))
            deadline = time.monotonic() + 5
            while not (results := d.poll()) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert results and results[0].ok, results
            dest = bufs[find_placement(placements, GroupRole.DECODE, "10.1.0.2", 0, tp).cluster_id]
            assert (dest.reshape(NUM_BLOCKS, BLOCK_LEN)[1] == p_addr["cluster_id"] + 1).all()
    finally:
        for t in ranks.values():
            t.close()

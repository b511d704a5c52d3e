"""The worker half moving real KV bytes between two CPU KV caches laid out as vLLM lays them out.

Most tests use `tests/fakes/memory_transport.py` (a test double that copies bytes in-process, with
explicit failure knobs); the last ones build two real `PDGateConnector` WORKER facades through vLLM's
`KVConnectorFactory` with the real NIXL transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pdgate.connector import worker
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.connector import PDGateConnector, PDGateConnectorMetadata, PDGateHandshake, PDGateWorkerMeta
from pdgate.connector.errors import ConfigError
from pdgate.connector.metadata import PullOutcome, RecvDone, RecvPlan, StepMetadata
from pdgate.connector.transport.errors import PullTimeout
from pdgate.connector.worker import WorkerHalf, regions_from_kv_caches
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

from pdgate.errors import Code
from tests.fakes.memory_transport import MemoryTransport
from tests.unit.connector_vllm.conftest import BLOCK_SIZE, HEAD_SIZE, LAYERS, NUM_KV_HEADS, kv_cache_config, vllm_config

NUM_BLOCKS = 64


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer views over one int8 buffer, `[blocks, kv_heads, block_size, 2*head]` bf16, as vLLM CPU does."""
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    per_layer = NUM_BLOCKS * NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
    buf = torch.zeros(per_layer * len(LAYERS), dtype=torch.int8)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randint(-128, 127, buf.shape, generator=g, dtype=torch.int8))
    return {
        name: buf[i * per_layer : (i + 1) * per_layer].view(torch.bfloat16).view(shape) for i, name in enumerate(LAYERS)
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes read as bf16 include NaNs, which never compare equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def cfg(**over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url="http://127.0.0.1:1", instance_id="w", url="http://127.0.0.1:1", model="tiny", role="both"
    )
    base.update(over)
    return ConnectorConfig(**base)


class Pair:
    def __init__(self, make_d: Callable[[], MemoryTransport] | None = None, **d_cfg: Any) -> None:
        self.p_kv = kv_caches(seed=1)
        self.d_kv = kv_caches(seed=None)
        self.p = WorkerHalf(cfg(), tp_rank=0, transport_factory=MemoryTransport)
        self.d = WorkerHalf(cfg(**d_cfg), tp_rank=0, transport_factory=make_d or MemoryTransport)
        self.p_addr = self.p.register_kv_caches(self.p_kv)
        self.d.register_kv_caches(self.d_kv)

    def pull(self, remote: tuple[int, ...], local: tuple[int, ...], req: str = "d1", tid: str = "t1") -> None:
        self.d.on_step(StepMetadata(pulls=(RecvPlan(req, tid, 9, remote, local, (self.p_addr,)),)))

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def wait_outcomes(worker: WorkerHalf, n: int = 1, timeout: float = 10.0) -> list[PullOutcome]:
    got: list[PullOutcome] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got.extend(worker.take_outcomes())
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} pull outcome(s) did not arrive within {timeout}s (got {got})")
        time.sleep(0.001)
    return got


def test_regions_follow_vllm_cpu_layout() -> None:
    kv = kv_caches(seed=None)
    regions = regions_from_kv_caches(kv)
    block_len = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
    assert [r.name for r in regions] == list(LAYERS)
    for r, t in zip(regions, kv.values(), strict=True):
        assert (r.base_ptr, r.block_len, r.stride, r.num_blocks) == (t.data_ptr(), block_len, block_len, NUM_BLOCKS)


def test_regions_accept_ascend_tuples_and_register_shared_tensors_once() -> None:
    k, v = torch.zeros(8, 16, 2, 32), torch.zeros(8, 16, 2, 32)
    regions = regions_from_kv_caches({"l0": (k, v), "l1": (k, v)})
    assert [r.name for r in regions] == ["l0.0", "l0.1"]
    assert regions[0].block_len == 16 * 2 * 32 * 4


def test_regions_refuse_a_block_that_is_not_contiguous() -> None:
    t = torch.zeros(2, 8, 4, 16).transpose(0, 1)  # dim 0 is no longer the outermost stride
    with pytest.raises(ValueError, match="contiguous"):
        regions_from_kv_caches({"l0": t})


def test_pull_copies_the_blocks_and_reports_after_confirmation(pair: Pair) -> None:
    pair.pull((3, 4, 5), (10, 11, 12))
    (oc,) = wait_outcomes(pair.d)
    block_len = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
    assert (oc.ok, oc.req_id, oc.transfer_id, oc.nblocks, oc.nbytes) == (True, "d1", "t1", 3, 3 * block_len * 2)
    for name in LAYERS:
        assert same(pair.d_kv[name][10:13], pair.p_kv[name][3:6])
        assert not pair.d_kv[name][13].any()  # nothing else written
    # Finished receiving only once the scheduler half confirmed (the ledger's DONE).
    assert pair.d.get_finished() == (None, None)
    pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", True),)))
    assert pair.d.get_finished() == (None, {"d1"})
    assert pair.d.take_load_errors() == set()


def test_failed_pull_reports_the_blocks_as_load_errors(pair: Pair) -> None:
    pair.p.close()  # the prefill went away
    pair.pull((3, 4), (10, 11))
    (oc,) = wait_outcomes(pair.d)
    assert not oc.ok and oc.code == "transport_peer_unreachable"
    pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", False, (10, 11)),)))
    assert pair.d.get_finished() == (None, {"d1"})
    assert pair.d.take_load_errors() == {10, 11}
    assert pair.d.take_load_errors() == set()


def _wait_finished(worker: WorkerHalf, timeout: float = 10.0) -> set[str]:
    """`get_finished` called step after step until it reports a finished receive (what vLLM does)."""
    deadline = time.monotonic() + timeout
    while True:
        _, recving = worker.get_finished()
        if recving:
            return recving
        if time.monotonic() > deadline:
            raise TimeoutError("no finished receive")
        time.sleep(0.001)


def test_a_pull_under_the_routers_claim_is_reported_in_the_step_it_ends(pair: Pair) -> None:
    """No round trip through the scheduler half: the get_finished that sees the pull end reports it,
    and the outcome tells the scheduler half it need not send a RecvDone."""
    pair.d.on_step(
        StepMetadata(pulls=(RecvPlan("d1", "t1", 9, (3, 4), (10, 11), (pair.p_addr,), trusted_until=time.time() + 60),))
    )
    assert _wait_finished(pair.d) == {"d1"}
    assert pair.d.take_load_errors() == set()
    (oc,) = pair.d.take_outcomes()
    assert oc.ok and oc.reported
    for name in LAYERS:
        assert same(pair.d_kv[name][10:12], pair.p_kv[name][3:5])
    assert pair.d.get_finished() == (None, None)  # reported once


def _trusted_pull(pair: Pair, *, idle: bool) -> StepMetadata:
    """One pull under the router's claim, in a step that computes nothing (`idle`) or one that does."""
    plan = RecvPlan("d1", "t1", 9, (3, 4), (10, 11), (pair.p_addr,), trusted_until=time.time() + 60)
    return StepMetadata(pulls=(plan,), idle=idle)


def test_an_idle_step_waits_for_its_pull_and_reports_it_in_that_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step in which no request computes (`StepMetadata.idle`: the engine only steps to poll the load)
    lets get_finished wait for the pull in flight, so the very step that started the pull reports it; before,
    get_finished returned at once and the report came steps later, the engine spinning through empty ones.
    The bound is set long here so that the pull's end, not a timer, ends the wait."""
    monkeypatch.setattr(worker, "_IDLE_WAIT_S", 60.0)
    pair = Pair(make_d=lambda: MemoryTransport(complete_after_polls=20))
    try:
        pair.d.on_step(_trusted_pull(pair, idle=True))
        assert pair.d.get_finished() == (None, {"d1"})  # one call: the step that started the pull
        (oc,) = pair.d.take_outcomes()
        assert oc.ok and oc.reported
        for name in LAYERS:
            assert same(pair.d_kv[name][10:12], pair.p_kv[name][3:5])
    finally:
        pair.close()


def test_a_step_that_computes_does_not_wait_for_a_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    """With requests computing, get_finished never blocks the batch on a pull (it would hang here: the
    pull never ends and the idle bound is a minute)."""
    monkeypatch.setattr(worker, "_IDLE_WAIT_S", 60.0)
    pair = Pair(make_d=lambda: MemoryTransport(complete_after_polls=10**9))
    try:
        pair.d.on_step(_trusted_pull(pair, idle=False))
        assert pair.d.get_finished() == (None, None)
    finally:
        pair.close()


def test_an_idle_wait_is_bounded_and_spent_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull that outlasts the bound is reported in a later step; the wait is spent once per step, so a
    second get_finished in the same step (none in vLLM, but nothing relies on it) returns at once."""
    monkeypatch.setattr(worker, "_IDLE_WAIT_S", 0.01)
    pair = Pair(make_d=lambda: MemoryTransport(complete_after_polls=10**9, pull_timeout_s=60.0))
    try:
        pair.d.on_step(_trusted_pull(pair, idle=True))
        assert pair.d.get_finished() == (None, None)
        monkeypatch.setattr(worker, "_IDLE_WAIT_S", 60.0)
        assert pair.d.get_finished() == (None, None)  # not idle any more: no second wait in the step
    finally:
        pair.close()


def test_a_failed_pull_under_the_routers_claim_reports_its_blocks_at_once(pair: Pair) -> None:
    pair.d.on_step(
        StepMetadata(
            pulls=(
                RecvPlan("d1", "t1", 9, (3, NUM_BLOCKS + 1), (10, 11), (pair.p_addr,), trusted_until=time.time() + 60),
            )
        )
    )
    assert _wait_finished(pair.d) == {"d1"}
    assert pair.d.take_load_errors() == {10, 11}
    (oc,) = pair.d.take_outcomes()
    assert not oc.ok and oc.reported


def test_a_pull_that_ends_past_the_routers_claim_waits_for_the_scheduler_half() -> None:
    now = [1000.0]
    pair = Pair()
    pair.d.close()
    pair.d = WorkerHalf(cfg(), tp_rank=0, transport_factory=MemoryTransport, wall=lambda: now[0])
    pair.d.register_kv_caches(pair.d_kv)
    try:
        now[0] = 2000.0  # the pull ends after the bound: the claim may have lapsed
        pair.d.on_step(
            StepMetadata(pulls=(RecvPlan("d1", "t1", 9, (3,), (10,), (pair.p_addr,), trusted_until=1500.0),))
        )
        (oc,) = wait_outcomes(pair.d)
        assert oc.ok and not oc.reported
        assert pair.d.get_finished() == (None, None)
        # DONE confirmed it: the scheduler half's RecvDone names this rank.
        pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", True, ranks=frozenset({0})),)))
        assert pair.d.get_finished() == (None, {"d1"})
    finally:
        pair.close()


def _sync_plan(pair: Pair, remote: tuple[int, ...] = (3, 4), until: float | None = None) -> StepMetadata:
    until = time.time() + 60 if until is None else until
    return StepMetadata(pulls=(RecvPlan("d1", "t1", 9, remote, (10, 11), (pair.p_addr,), until, sync=True),))


def test_a_synchronous_pull_has_landed_when_start_load_kv_returns_and_is_never_reported() -> None:
    """vLLM computes a synchronously loaded request in the same step, right after `start_load_kv`: the
    bytes must be there when it returns (the pull here needs 20 polls of the transfer thread), and vLLM
    expects no finished-receiving report for it, in this step or any later one."""
    pair = Pair(make_d=lambda: MemoryTransport(complete_after_polls=20))
    try:
        pair.d.on_step(_sync_plan(pair))
        for name in LAYERS:
            assert same(pair.d_kv[name][10:12], pair.p_kv[name][3:5])
        assert pair.d.get_finished() == (None, None)
        assert pair.d.take_load_errors() == set()
        (oc,) = pair.d.take_outcomes(drain=False)
        assert oc.ok and oc.reported and oc.waited_s > 0
        pair.d.on_step(StepMetadata())
        assert pair.d.get_finished() == (None, None)
    finally:
        pair.close()


def test_a_failed_synchronous_pull_marks_its_blocks_as_load_errors_in_the_same_step(pair: Pair) -> None:
    pair.d.on_step(_sync_plan(pair, remote=(3, NUM_BLOCKS + 1)))
    assert pair.d.take_load_errors() == {10, 11}
    assert pair.d.get_finished() == (None, None)
    (oc,) = pair.d.take_outcomes(drain=False)
    assert not oc.ok and oc.reported


def test_a_synchronous_pull_that_ends_past_the_routers_claim_fails() -> None:
    """No DONE can confirm it before the forward that reads it, so a late one is a load error, not used."""
    pair = Pair()
    pair.d.close()
    pair.d = WorkerHalf(cfg(), tp_rank=0, transport_factory=MemoryTransport, wall=lambda: 2000.0)
    pair.d.register_kv_caches(pair.d_kv)
    try:
        pair.d.on_step(_sync_plan(pair, until=1500.0))
        assert pair.d.take_load_errors() == {10, 11}
        (oc,) = pair.d.take_outcomes(drain=False)
        assert (oc.ok, oc.code, oc.reported) == (False, Code.KV_LOAD_TIMEOUT, True)
    finally:
        pair.close()


def test_a_synchronous_failure_decided_by_the_scheduler_half_only_marks_blocks() -> None:
    pair = Pair()
    try:
        pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", False, (10, 11), sync=True),)))
        assert pair.d.take_load_errors() == {10, 11}
        assert pair.d.get_finished() == (None, None)
    finally:
        pair.close()


def test_siblings_pull_one_transfer_into_their_own_blocks_at_once(pair: Pair) -> None:
    """vLLM's n > 1: two requests load the same handoff; the transport gets a distinct id for each."""
    until = time.time() + 60
    pair.d.on_step(
        StepMetadata(
            pulls=(
                RecvPlan("0_d", "t1", 9, (3, 4), (10, 11), (pair.p_addr,), trusted_until=until),
                RecvPlan("1_d", "t1", 9, (3, 4), (20, 21), (pair.p_addr,), trusted_until=until),
            )
        )
    )
    done: set[str] = set()
    while len(done) < 2:
        done |= _wait_finished(pair.d)
    assert done == {"0_d", "1_d"}
    outcomes = pair.d.take_outcomes()
    assert sorted((o.req_id, o.transfer_id, o.ok) for o in outcomes) == [("0_d", "t1", True), ("1_d", "t1", True)]
    for name in LAYERS:
        assert same(pair.d_kv[name][10:12], pair.p_kv[name][3:5])
        assert same(pair.d_kv[name][20:22], pair.p_kv[name][3:5])


def test_a_recv_done_for_other_ranks_only_is_not_reported_here(pair: Pair) -> None:
    pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", True, ranks=frozenset({1})),)))
    assert pair.d.get_finished() == (None, None)


def test_bad_block_ids_fail_the_pull_not_the_worker(pair: Pair) -> None:
    pair.pull((3, NUM_BLOCKS + 1), (10, 11))
    (oc,) = wait_outcomes(pair.d)
    assert not oc.ok and oc.code == "transport_bad_request"
    pair.pull((3,), (10,), req="d2", tid="t2")  # the worker goes on
    assert wait_outcomes(pair.d)[0].ok


def test_a_failure_decided_while_the_pull_runs_waits_for_the_pull_to_stop() -> None:
    pair = Pair(make_d=lambda: MemoryTransport(complete_after_polls=10**9, pull_timeout_s=0.3))
    try:
        pair.pull((3,), (10,))
        # The scheduler half gave up (its deadline) while our pull may still write into block 10.
        pair.d.on_step(StepMetadata(recv_done=(RecvDone("d1", False, (10,)),)))
        assert pair.d.get_finished() == (None, None)
        (oc,) = wait_outcomes(pair.d)
        assert oc.code == PullTimeout.code
        assert pair.d.get_finished() == (None, {"d1"})
        assert pair.d.take_load_errors() == {10}
    finally:
        pair.close()


def test_corrupt_pulled_bytes_flips_what_was_pulled() -> None:
    pair = Pair(corrupt_pulled_bytes=True)
    try:
        pair.pull((3,), (10,))
        assert wait_outcomes(pair.d)[0].ok
        for name in LAYERS:
            got = pair.d_kv[name][10].view(torch.uint8)
            want = pair.p_kv[name][3].view(torch.uint8) ^ 0x5A
            assert torch.equal(got, want)
    finally:
        pair.close()


def test_prefill_reports_frees_exactly_once(pair: Pair) -> None:
    pair.p.on_step(StepMetadata(holds=("p1", "p2")))
    assert pair.p.get_finished() == (None, None)
    pair.p.on_step(StepMetadata(frees=("p1",)))
    assert pair.p.get_finished() == ({"p1"}, None)
    assert pair.p.get_finished() == (None, None)


def test_a_worker_without_a_source_for_its_rank_fails_the_pull(pair: Pair) -> None:
    rank1 = WorkerHalf(cfg(), tp_rank=1, transport_factory=MemoryTransport)
    try:
        rank1.register_kv_caches(kv_caches(seed=None))
        rank1.on_step(StepMetadata(pulls=(RecvPlan("d1", "t1", 9, (3,), (10,), (pair.p_addr,)),)))
        (oc,) = rank1.take_outcomes()
        assert not oc.ok and "tp rank 1" in (oc.message or "")
    finally:
        rank1.close()


def test_corrupt_mode_is_refused_for_device_memory() -> None:
    worker = WorkerHalf(cfg(corrupt_pulled_bytes=True), tp_rank=0, transport_factory=MemoryTransport)
    on_device = {name: torch.empty(NUM_BLOCKS, 2, 32, 64, device="meta") for name in LAYERS}
    with pytest.raises(ConfigError, match="CPU"):
        worker.register_kv_caches(on_device)


# ---- the facade in the WORKER role, with real NIXL -------------------------------------------------


def worker_connector(model_dir: Path, name: str, **extra: Any) -> PDGateConnector:
    config = vllm_config(
        model_dir,
        kv_role="kv_both",
        extra={
            "metaserver_url": "http://127.0.0.1:1",
            "url": "http://127.0.0.1:1",
            "instance_id": name,
            "transport_options": {"ucx_net_devices": "lo"},
            **extra,
        },
    )
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config(NUM_BLOCKS))
    assert isinstance(conn, PDGateConnector)
    return conn


def step(conn: PDGateConnector, meta: StepMetadata) -> tuple[Any, Any, set[int], PDGateWorkerMeta | None]:
    """One engine step as vLLM's model runner drives the worker connector."""
    conn.bind_connector_metadata(PDGateConnectorMetadata(meta))
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.wait_for_save()
    sending, recving = conn.get_finished(set())
    errors = conn.get_block_ids_with_load_errors()
    worker_meta = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    assert worker_meta is None or isinstance(worker_meta, PDGateWorkerMeta)
    return sending, recving, errors, worker_meta


def test_worker_facades_pull_over_nixl(model_dir: Path) -> None:
    p = worker_connector(model_dir, "nixl-p")
    d = worker_connector(model_dir, "nixl-d")
    try:
        p_kv, d_kv = kv_caches(seed=7), kv_caches(seed=None)
        p.register_kv_caches(p_kv)
        d.register_kv_caches(d_kv)
        hs = p.get_handshake_metadata()
        assert isinstance(hs, PDGateHandshake) and hs.tp_rank == 0 and hs.address["kind"] == "nixl"
        step(p, StepMetadata(holds=("p1",)))  # the prefill polls NIXL while it holds blocks
        plan = RecvPlan("d1", "t1", 9, (1, 2, 3), (20, 21, 22), (hs.address,))
        outcomes: list[PullOutcome] = []
        _, recving, _, meta = step(d, StepMetadata(pulls=(plan,)))
        assert recving is None
        deadline = time.monotonic() + 20
        while not outcomes:
            if meta is not None:
                outcomes.extend(meta.outcomes)
            assert time.monotonic() < deadline, "NIXL pull did not finish"
            step(p, StepMetadata())
            *_, meta = step(d, StepMetadata())
        (oc,) = outcomes
        assert oc.ok, oc.message
        for name in LAYERS:
            assert same(d_kv[name][20:23], p_kv[name][1:4])
        _, recving, errors, _ = step(d, StepMetadata(recv_done=(RecvDone("d1", True),)))
        assert recving == {"d1"} and errors == set()
        sending, *_ = step(p, StepMetadata(frees=("p1",)))
        assert sending == {"p1"}
    finally:
        p.shutdown()
        d.shutdown()


def test_a_stalled_synchronous_pull_holds_the_step_only_until_its_own_deadline() -> None:
    """A prefill that never answers must not freeze an idle decode for the whole `pull_timeout_s`: the
    synchronous pull carries `sync_pull_timeout_s` as its deadline, and the step ends with its blocks as
    load errors (vLLM then fails the request, typed, and the router answers the client)."""
    seen: list[float | None] = []

    class Recording(MemoryTransport):
        def start_pull(self, req: Any) -> None:
            seen.append(req.timeout_s)
            super().start_pull(req)

    pair = Pair(make_d=lambda: Recording(complete_after_polls=10**9), sync_pull_timeout_s=0.2, pull_timeout_s=600.0)
    try:
        pair.d.on_step(_sync_plan(pair))
        assert seen == [0.2]
        assert pair.d.take_load_errors() == {10, 11}
        (oc,) = pair.d.take_outcomes(drain=False)
        assert (oc.ok, oc.code) == (False, PullTimeout.code)
        pair.pull((3,), (12,), req="d2", tid="t2")  # an asynchronous pull keeps the transport's deadline
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:  # the transfer thread submits it
            time.sleep(0.001)
        assert seen == [0.2, None]
    finally:
        pair.close()

"""Layer-wise loading (`connector/layerwise.py`) in the worker half, over real CPU KV tensors laid out as vLLM
lays them out, with the in-process memory transport (`tests/fakes/memory_transport.py`) held back or failed
per layer. What vLLM's model runner does around it (the hooks' order, one call per layer) is driven by
hand here, in vLLM's order: `start_load_kv`, then per layer `wait_for_layer_load`, then `wait_for_save`
and `get_finished`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pdgate.connector.layerwise import layer_groups, use_layerwise
from pdgate.connector.metadata import RecvPlan, StepMetadata
from pdgate.connector.transport.base import KVRegion, PullResult
from pdgate.connector.transport.errors import PeerUnreachable
from pdgate.connector.worker import WorkerHalf, regions_from_kv_caches

from pdgate.errors import Code
from tests.fakes.memory_transport import MemoryTransport, _Pending
from tests.unit.connector_vllm.conftest import BLOCK_SIZE, LAYERS
from tests.unit.connector_vllm.test_worker_half import cfg, kv_caches, same


class LayerGate(MemoryTransport):
    """Memory transport that records each pull's regions, holds back the pulls of regions >= `hold_from`
    until `release` is set, and fails the pulls of the regions in `fail`."""

    def __init__(self, *, hold_from: int | None = None, fail: frozenset[int] = frozenset(), **kw: Any) -> None:
        super().__init__(**kw)
        self.hold_from = hold_from
        self.release = threading.Event()
        self.fail = fail
        self.started: list[tuple[int, ...] | None] = []

    def start_pull(self, req: Any) -> None:
        super().start_pull(req)
        self.started.append(req.regions)

    def _held(self, p: _Pending) -> bool:
        regions = p.req.regions or (0,)
        return self.hold_from is not None and min(regions) >= self.hold_from and not self.release.is_set()

    def poll(self) -> list[PullResult]:
        held = {tid: p for tid, p in self._pending.items() if self._held(p)}
        for tid in held:
            del self._pending[tid]
        try:
            return super().poll()
        finally:
            self._pending.update(held)

    def _complete(self, p: _Pending, now: float) -> PullResult:
        if set(p.req.regions or ()) & self.fail:
            return PullResult.failure(p.req.transfer_id, PeerUnreachable(f"layer pull {p.req.transfer_id} broke"))
        return super()._complete(p, now)


class Pair:
    """A prefill and a decode worker; the decode loads layer by layer from 2 blocks (64 tokens) on."""

    def __init__(self, d: LayerGate, *, min_tokens: float | None = 2 * BLOCK_SIZE) -> None:
        self.p_kv = kv_caches(seed=1)
        self.d_kv = kv_caches(seed=None)
        self.p = WorkerHalf(cfg(), tp_rank=0, transport_factory=MemoryTransport)
        self.d_transport = d
        self.d = WorkerHalf(
            cfg(layerwise_min_tokens=min_tokens), tp_rank=0, transport_factory=lambda: d, block_size=BLOCK_SIZE
        )
        self.p_addr = self.p.register_kv_caches(self.p_kv)
        self.d.register_kv_caches(self.d_kv)

    def start(self) -> None:
        plan = RecvPlan("d1", "t1", 9, (3, 4), (10, 11), (self.p_addr,), time.time() + 60, sync=True)
        self.d.on_step(StepMetadata(pulls=(plan,)))

    def landed(self, layer: str) -> bool:
        return same(self.d_kv[layer][10:12], self.p_kv[layer][3:5])

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture
def gated() -> Iterator[Pair]:
    pair = Pair(LayerGate(hold_from=1))
    yield pair
    pair.d_transport.release.set()
    pair.close()


def test_layer_groups_follow_vllm_cpu_and_ascend_layouts() -> None:
    cpu = regions_from_kv_caches(kv_caches(seed=None))
    assert layer_groups(LAYERS, cpu) == {LAYERS[0]: (0,), LAYERS[1]: (1,)}
    pairs = {"a.attn": (torch.zeros(4, 8), torch.zeros(4, 8)), "a.attn2": (torch.zeros(4, 8), torch.zeros(4, 8))}
    ascend = regions_from_kv_caches(pairs)
    assert layer_groups(pairs, ascend) == {"a.attn": (0, 1), "a.attn2": (2, 3)}  # a prefix is not a layer
    shared = torch.zeros(4, 8)
    assert layer_groups(["x", "y"], regions_from_kv_caches({"x": shared, "y": shared})) == {"x": (0,)}


def test_the_threshold_counts_whole_blocks_and_needs_two_layers() -> None:
    assert use_layerwise(64, 2, 32, 2)
    assert not use_layerwise(65, 2, 32, 2)
    assert not use_layerwise(None, 100, 32, 2)  # unset: never
    assert not use_layerwise(0, 100, 32, 1)  # one layer: nothing to overlap
    assert not use_layerwise(0, 100, None, 2)


def test_start_load_kv_returns_at_once_and_each_layer_waits_only_for_itself(gated: Pair) -> None:
    """Layer 1 is held back in the transport: `start_load_kv` returns, layer 0 has landed when its wait
    returns while layer 1 has not, and layer 1's wait returns once it landed. One pull per layer, in layer
    order; the load is never reported as finished receiving (vLLM expects no report of a synchronous load)."""
    gated.start()
    assert not gated.landed(LAYERS[0]) or not gated.landed(LAYERS[1])
    # ...but the last block, which vLLM writes the step's token into before the layer's wait, landed first
    assert same(gated.d_kv[LAYERS[1]][11:12], gated.p_kv[LAYERS[1]][4:5])
    gated.d.wait_for_layer_load(LAYERS[0])
    assert gated.landed(LAYERS[0]) and not gated.landed(LAYERS[1])
    threading.Timer(0.05, gated.d_transport.release.set).start()
    gated.d.wait_for_layer_load(LAYERS[1])
    assert gated.landed(LAYERS[1])
    assert gated.d_transport.started == [None, (0,), (1,)]  # the last block (every layer) first
    (l0, _), (l1, w1) = list(gated.d.layer_waits)
    assert (l0, l1) == (0, 1)
    assert w1 >= 0.04  # it blocked on the held layer, not on layer 0's wait
    gated.d.finish_layered()
    assert gated.d.get_finished() == (None, None)
    assert gated.d.take_load_errors() == set()
    (oc,) = gated.d.take_outcomes(drain=False)
    assert oc.ok and oc.reported and oc.nblocks == 2 and oc.nbytes == 2 * 2 * gated.p_kv[LAYERS[0]][0].nbytes


def test_a_failure_at_layer_k_fails_the_request_with_its_typed_error_and_holds_nothing() -> None:
    """Layer 1's read breaks: its wait still returns (the forward cannot stop midway), the request's blocks
    are load errors of the step, the outcome carries the transport's typed error, and when the step ends
    no read is still writing and the worker tracks nothing of the request any more."""
    pair = Pair(LayerGate(fail=frozenset({1})))
    try:
        pair.start()
        for layer in LAYERS:
            pair.d.wait_for_layer_load(layer)
        pair.d.finish_layered()
        assert pair.landed(LAYERS[0])
        assert pair.d.take_load_errors() == {10, 11}
        assert pair.d.get_finished() == (None, None)
        (oc,) = pair.d.take_outcomes(drain=False)
        assert (oc.ok, oc.code, oc.reported) == (False, Code.TRANSPORT_PEER_UNREACHABLE, True)
        assert "broke" in (oc.message or "")
        assert pair.d_transport._pending == {}
        assert not pair.d._inflight and not pair.d._layered and not pair.d._sync_started
    finally:
        pair.close()


def test_a_short_load_is_pulled_whole_before_the_forward() -> None:
    pair = Pair(LayerGate(), min_tokens=3 * BLOCK_SIZE)
    try:
        pair.start()
        assert pair.landed(LAYERS[0]) and pair.landed(LAYERS[1])  # start_load_kv waited for all of it
        assert pair.d_transport.started == [None]
        pair.d.wait_for_layer_load(LAYERS[0])
        assert not pair.d.layer_waits  # nothing layer-wise to wait for
    finally:
        pair.close()


class Whole(LayerGate):
    layerwise = False


def test_a_transport_that_pulls_whole_caches_ends_every_layer_with_one_pull() -> None:
    pair = Pair(Whole())
    try:
        pair.start()
        for layer in LAYERS:
            pair.d.wait_for_layer_load(layer)
            assert pair.landed(layer)
        pair.d.finish_layered()
        assert pair.d_transport.started == [None]
        (oc,) = pair.d.take_outcomes(drain=False)
        assert oc.ok
    finally:
        pair.close()


def test_a_layer_wait_without_a_layer_wise_load_returns_at_once(gated: Pair) -> None:
    gated.d.wait_for_layer_load(LAYERS[0])
    gated.d.wait_for_layer_load("not.a.layer")
    assert not gated.d.layer_waits


def test_pull_request_refuses_region_indexes_out_of_range(gated: Pair) -> None:
    regions = [KVRegion.dense("a", 4096, 64, 4)]
    from pdgate.connector.transport.base import PullRequest, check_pull_against
    from pdgate.connector.transport.errors import InvalidPull

    for bad in ((), (1,), (0, 0)):
        req = PullRequest("t", 1, {}, (0,), (0,), regions=bad)
        with pytest.raises(InvalidPull, match="regions"):
            check_pull_against(req, regions, regions)
    check_pull_against(PullRequest("t", 1, {}, (0,), (0,), regions=(0,)), regions, regions)


def test_the_claims_bound_is_judged_by_when_the_layers_landed_not_when_the_step_ended() -> None:
    """The forward between the layer waits may take long; a load whose every layer was seen landing before
    the router claim's bound is good even when the step ends past it, and one that was not is a load error."""
    for landed_at, ok in ((1000.0, True), (2000.0, False)):
        now = [landed_at]
        pair = Pair(LayerGate())
        pair.d.close()
        pair.d = WorkerHalf(
            cfg(layerwise_min_tokens=2 * BLOCK_SIZE),
            tp_rank=0,
            transport_factory=lambda: LayerGate(),
            block_size=BLOCK_SIZE,
            wall=lambda now=now: now[0],  # type: ignore[misc]
        )
        pair.d.register_kv_caches(pair.d_kv)
        try:
            plan = RecvPlan("d1", "t1", 9, (3, 4), (10, 11), (pair.p_addr,), 1500.0, sync=True)
            pair.d.on_step(StepMetadata(pulls=(plan,)))
            for layer in LAYERS:
                pair.d.wait_for_layer_load(layer)
            now[0] = 3000.0  # the forward ran past the bound
            pair.d.finish_layered()
            (oc,) = pair.d.take_outcomes(drain=False)
            assert oc.ok is ok and pair.d.take_load_errors() == (set() if ok else {10, 11})
        finally:
            pair.close()


def _real(kind: str) -> Any:
    if kind == "nixl":
        from pdgate.connector.transport.nixl import NixlTransport

        return NixlTransport(ucx_net_devices="lo")
    from pdgate.connector.transport.mooncake import MooncakeTransport

    return MooncakeTransport()


@pytest.mark.parametrize("kind", ["nixl", "mooncake"])
def test_real_transports_pull_one_layer_per_pull(kind: str) -> None:
    """NIXL and Mooncake honour `PullRequest.regions`: each layer's pull writes that layer's blocks only."""
    p_kv, d_kv = kv_caches(seed=1), kv_caches(seed=None)
    p = WorkerHalf(cfg(), tp_rank=0, transport_factory=lambda: _real(kind))
    d = WorkerHalf(
        cfg(layerwise_min_tokens=BLOCK_SIZE), tp_rank=0, transport_factory=lambda: _real(kind), block_size=BLOCK_SIZE
    )
    try:
        addr = p.register_kv_caches(p_kv)
        p.on_step(StepMetadata(holds=("held",)))  # NIXL needs the target to make progress
        d.register_kv_caches(d_kv)
        plan = RecvPlan("d1", "t1", 9, (3, 4), (10, 11), (addr,), time.time() + 60, sync=True)
        d.on_step(StepMetadata(pulls=(plan,)))
        for layer in LAYERS:
            d.wait_for_layer_load(layer)
            assert same(d_kv[layer][10:12], p_kv[layer][3:5])
        d.finish_layered()
        (oc,) = d.take_outcomes(drain=False)
        assert oc.ok and oc.nbytes == 2 * 2 * p_kv[LAYERS[0]][0].nbytes
        assert not same(d_kv[LAYERS[0]][12:13], p_kv[LAYERS[0]][5:6])  # nothing beyond the plan moved
    finally:
        d.close()
        p.close()


def test_layer_counts_name_a_wait_below_one_already_waited_for() -> None:
    from pdgate.connector.layerwise import layer_counts

    assert layer_counts([0, 1, 2, 3]) == {"recv_layerwise": 1, "layer_waits": 4, "layer_waits_out_of_order": 0}
    assert layer_counts([0, 2, 1, 3, 0]) == {"recv_layerwise": 1, "layer_waits": 5, "layer_waits_out_of_order": 2}
    assert layer_counts([]) == {"recv_layerwise": 1, "layer_waits": 0, "layer_waits_out_of_order": 0}

"""Sub-block pulls for sharded KV over unequal TP (`connector.blocks.hetero_reads`).

The plan is checked byte for byte on synthetic regions (2->1, 4->2, 1->2, 2->4 with GQA head counts), then
executed: real KV tensors laid out as vLLM CPU lays them out (per layer `[blocks, kv_heads, block_size,
2*head]`, every layer a view into one buffer), each rank behind its own in-process `MemoryTransport`, the
prefill's regions read back out of a READY location as a decode finds them; after the pulls each decode
rank's blocks hold exactly its own heads of the same data.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pdgate.connector.blocks import BlockPlan, SubBlockRead, hetero_reads
from pdgate.connector.errors import LocationError, TPLayoutError
from pdgate.connector.location import EngineFacts, addresses_from_workers, location_for, prefill_regions
from pdgate.connector.transport.base import ByteRange, KVRegion, PullRequest
from pdgate.connector.transport.errors import InvalidPull
from pdgate.connector.worker import regions_from_kv_caches

from pdgate.contract import rank_heads
from pdgate.models import TransportAddress
from tests.fakes.memory_transport import MemoryTransport

HB = 64  # bytes of one KV head in one block, in the synthetic plans
NB = 8  # blocks per region
LAYERS = ("layer.0", "layer.1")
PLAN = BlockPlan(remote_block_ids=(3, 4), local_block_ids=(5, 6))


def regions(base: int, heads: int) -> list[KVRegion]:
    """One rank's regions: every layer's blocks back to back after the previous layer's, as vLLM allocates."""
    per = heads * HB
    return [KVRegion.dense(name, base + i * NB * per, per, NB) for i, name in enumerate(LAYERS)]


def prefill(tp: int, heads: int) -> dict[int, list[KVRegion]]:
    return {r: regions(0x100000 * (r + 1), len(rank_heads(r, heads, tp))) for r in range(tp)}


D = 0x10000000  # the decode rank's base address


def plan(d: int, ptp: int, dtp: int, heads: int) -> list[SubBlockRead]:
    mine = len(rank_heads(d, heads, dtp))
    return hetero_reads(d, ptp, dtp, heads, PLAN, prefill(ptp, heads), regions(D, mine))


def test_p2_to_d1_gathers_each_block_from_both_prefill_ranks() -> None:
    # 2 KV heads (the tiny model): each prefill rank holds one head, the decode rank both, rank 0's first.
    p0, p1 = 0x100000, 0x200000
    d_layer1, p_layer1 = D + NB * 2 * HB, NB * HB  # a layer's offset on the decode / on a prefill rank
    assert plan(0, 2, 1, 2) == [
        SubBlockRead(0, p0 + 3 * HB, D + 5 * 2 * HB, HB),
        SubBlockRead(0, p0 + 4 * HB, D + 6 * 2 * HB, HB),
        SubBlockRead(0, p0 + p_layer1 + 3 * HB, d_layer1 + 5 * 2 * HB, HB),
        SubBlockRead(0, p0 + p_layer1 + 4 * HB, d_layer1 + 6 * 2 * HB, HB),
        SubBlockRead(1, p1 + 3 * HB, D + 5 * 2 * HB + HB, HB),
        SubBlockRead(1, p1 + 4 * HB, D + 6 * 2 * HB + HB, HB),
        SubBlockRead(1, p1 + p_layer1 + 3 * HB, d_layer1 + 5 * 2 * HB + HB, HB),
        SubBlockRead(1, p1 + p_layer1 + 4 * HB, d_layer1 + 6 * 2 * HB + HB, HB),
    ]


def test_p4_to_d2_reads_two_whole_prefill_blocks_into_each_decode_block() -> None:
    # 8 KV heads: prefill ranks hold 2, decode ranks 4; decode rank 1 takes prefill ranks 2 and 3 whole.
    got = plan(1, 4, 2, 8)
    assert {r.prefill_rank for r in got} == {2, 3}
    p2 = 0x300000
    assert got[:2] == [
        SubBlockRead(2, p2 + 3 * 2 * HB, D + 5 * 4 * HB, 2 * HB),
        SubBlockRead(2, p2 + 4 * 2 * HB, D + 6 * 4 * HB, 2 * HB),
    ]
    p3 = 0x400000
    assert got[4] == SubBlockRead(3, p3 + 3 * 2 * HB, D + 5 * 4 * HB + 2 * HB, 2 * HB)
    assert sum(r.nbytes for r in got) == len(LAYERS) * len(PLAN.local_block_ids) * 4 * HB


def test_p4_to_d2_with_replicated_heads_merges_consecutive_whole_blocks() -> None:
    # 2 KV heads over prefill tp 4 (each head on two ranks): decode rank 1's block is prefill rank 2's, whole,
    # so blocks 3,4 -> 5,6 are one range per layer (the layers do not continue each other: blocks 5.. follow).
    p2 = 0x300000
    assert plan(1, 4, 2, 2) == [
        SubBlockRead(2, p2 + 3 * HB, D + 5 * HB, 2 * HB),
        SubBlockRead(2, p2 + NB * HB + 3 * HB, D + NB * HB + 5 * HB, 2 * HB),
    ]


def test_p1_to_d2_reads_half_of_each_prefill_block() -> None:
    p0 = 0x100000
    p_layer1, d_layer1 = NB * 2 * HB, D + NB * HB
    assert plan(1, 1, 2, 2) == [
        SubBlockRead(0, p0 + 3 * 2 * HB + HB, D + 5 * HB, HB),
        SubBlockRead(0, p0 + 4 * 2 * HB + HB, D + 6 * HB, HB),
        SubBlockRead(0, p0 + p_layer1 + 3 * 2 * HB + HB, d_layer1 + 5 * HB, HB),
        SubBlockRead(0, p0 + p_layer1 + 4 * 2 * HB + HB, d_layer1 + 6 * HB, HB),
    ]


def test_p2_to_d4_reads_a_quarter_of_the_heads_from_one_prefill_rank() -> None:
    # 8 KV heads: prefill ranks hold 4, decode ranks 2; decode rank 3 takes heads 6,7 = prefill rank 1's last two.
    p1 = 0x200000
    got = plan(3, 2, 4, 8)
    assert got[:2] == [
        SubBlockRead(1, p1 + 3 * 4 * HB + 2 * HB, D + 5 * 2 * HB, 2 * HB),
        SubBlockRead(1, p1 + 4 * 4 * HB + 2 * HB, D + 6 * 2 * HB, 2 * HB),
    ]
    assert len(got) == 4 and {r.prefill_rank for r in got} == {1}


def test_a_prefill_rank_whose_blocks_hold_other_heads_is_refused() -> None:
    wrong = prefill(2, 2)
    wrong[1] = regions(0x200000, 2)  # rank 1 claims two heads per block: not this model at tp 2
    with pytest.raises(TPLayoutError, match=r"rank 1's region 'layer\.0' has 128 B blocks"):
        hetero_reads(0, 2, 1, 2, PLAN, wrong, regions(D, 2))


def test_a_prefill_rank_without_regions_is_refused() -> None:
    with pytest.raises(TPLayoutError, match="no KV regions for tp rank 1"):
        hetero_reads(0, 2, 1, 2, PLAN, {0: prefill(2, 2)[0]}, regions(D, 2))


def test_tps_that_do_not_fit_are_refused() -> None:
    with pytest.raises(TPLayoutError, match="cannot be re-cut"):
        hetero_reads(0, 3, 2, 6, PLAN, {}, regions(D, 3))


# ---- execution over the in-process memory transport --------------------------------------------------------

BLOCK_SIZE, HEAD, BLOCKS = 4, 8, 6


def vllm_cpu_kv(heads: int, fill: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer views over one buffer, `[blocks, heads, block_size, 2*head]` bf16, as vLLM CPU allocates."""
    per = BLOCKS * heads * BLOCK_SIZE * 2 * HEAD
    buf = torch.zeros(per * len(LAYERS), dtype=torch.bfloat16)
    kv = {name: buf[i * per : (i + 1) * per].view(BLOCKS, heads, BLOCK_SIZE, 2 * HEAD) for i, name in enumerate(LAYERS)}
    if fill is not None:
        for i, name in enumerate(LAYERS):
            kv[name].copy_(fill[i])
    return kv


_alive: list[dict[str, torch.Tensor]] = []  # KV a transport serves: it holds raw pointers into it


@pytest.fixture
def names() -> Iterator[list[MemoryTransport]]:
    made: list[MemoryTransport] = []
    yield made
    for t in made:
        t.close()
    _alive.clear()


def serve(kv: dict[str, torch.Tensor], made: list[MemoryTransport]) -> MemoryTransport:
    t = MemoryTransport()
    t.register(regions_from_kv_caches(kv))
    made.append(t)
    _alive.append(kv)
    return t


def ready_location(addresses: list[TransportAddress], tp: int, heads: int) -> dict[int, list[KVRegion]]:
    """The prefill's regions as a decode reads them: out of the READY location's per-rank addresses."""
    facts = EngineFacts(
        "p1", "e1", "127.0.0.1", 0, tp, tp, BLOCK_SIZE, "bfloat16", f"d/bf16/L2/H{heads}/D8/B4", False, "nixl"
    )
    loc, _ = location_for(
        facts, block_ids=[1, 4], num_tokens=2 * BLOCK_SIZE, addresses=addresses, remote_request_id="r"
    )
    return prefill_regions(loc)


def pull(t: MemoryTransport, peers: dict[int, MemoryTransport], reads: list[SubBlockRead], tid: str) -> int:
    """One pull per prefill rank, its ranges together; polled to the end."""
    for rank, peer in peers.items():
        ranges = [ByteRange(r.src_addr, r.dst_addr, r.nbytes) for r in reads if r.prefill_rank == rank]
        if ranges:
            t.start_pull(PullRequest(f"{tid}.{rank}", 7, peer.local_address(), (1, 4), (2, 5), ranges=ranges))
    results = t.poll()
    assert results and all(r.ok for r in results), results
    return sum(r.nbytes for r in results)


@pytest.mark.parametrize(("ptp", "dtp", "heads"), [(2, 1, 2), (1, 2, 2), (4, 2, 8), (2, 4, 8), (4, 2, 2)])
def test_decode_ranks_hold_their_heads_of_the_prefills_kv(
    ptp: int, dtp: int, heads: int, names: list[MemoryTransport]
) -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(len(LAYERS), BLOCKS, heads, BLOCK_SIZE, 2 * HEAD, generator=g).bfloat16()
    held = [rank_heads(r, heads, ptp) for r in range(ptp)]
    pre = {r: serve(vllm_cpu_kv(len(h), full[:, :, h.start : h.stop]), names) for r, h in enumerate(held)}
    addresses = addresses_from_workers({r: t.local_address() for r, t in pre.items()})
    peers_regions = ready_location(addresses, ptp, len(rank_heads(0, heads, ptp)))
    plan = BlockPlan(remote_block_ids=(1, 4), local_block_ids=(2, 5))
    for d in range(dtp):
        h = rank_heads(d, heads, dtp)
        kv = vllm_cpu_kv(len(h))
        t = serve(kv, names)
        reads = hetero_reads(d, ptp, dtp, heads, plan, peers_regions, t.regions)
        moved = pull(t, pre, reads, f"x{d}")
        assert moved == 2 * len(LAYERS) * len(h) * BLOCK_SIZE * 2 * HEAD * 2
        for i, name in enumerate(LAYERS):
            want = full[i][:, h.start : h.stop]
            assert torch.equal(kv[name][[2, 5]], want[[1, 4]]), (ptp, dtp, heads, d, name)
            untouched = [b for b in range(BLOCKS) if b not in (2, 5)]
            assert not kv[name][untouched].any()


def test_a_transport_without_sub_block_reads_refuses_ranges(names: list[MemoryTransport]) -> None:
    class WholeBlocks(MemoryTransport):
        sub_block = False

    src = serve(vllm_cpu_kv(2), names)
    t = WholeBlocks()
    names.append(t)
    _alive.append(kv := vllm_cpu_kv(1))
    t.register(regions_from_kv_caches(kv))
    r = t.regions[0]
    with pytest.raises(InvalidPull, match="cannot pull byte ranges"):
        t.start_pull(
            PullRequest(
                "x", 1, src.local_address(), (0,), (0,), ranges=[ByteRange(src.regions[0].base_ptr, r.base_ptr, 8)]
            )
        )


def test_a_range_outside_the_registered_memory_is_refused(names: list[MemoryTransport]) -> None:
    src, dst = serve(vllm_cpu_kv(2), names), serve(vllm_cpu_kv(1), names)
    s, d = src.regions[-1], dst.regions[0]
    end = s.base_ptr + s.extent
    with pytest.raises(InvalidPull, match="outside the peer's KV regions"):
        dst.start_pull(PullRequest("x", 1, src.local_address(), (0,), (0,), ranges=[ByteRange(end - 4, d.base_ptr, 8)]))
    inside = [ByteRange(s.base_ptr, d.base_ptr, 8)]
    with pytest.raises(InvalidPull, match="byte ranges or regions, not both"):
        dst.start_pull(PullRequest("z", 1, src.local_address(), (0,), (0,), regions=(0,), ranges=inside))
    with pytest.raises(InvalidPull, match="two ranges write"):
        dst.start_pull(
            PullRequest(
                "y",
                1,
                src.local_address(),
                (0,),
                (0,),
                ranges=[ByteRange(s.base_ptr, d.base_ptr, 8), ByteRange(s.base_ptr, d.base_ptr + 4, 8)],
            )
        )


def test_a_location_without_regions_is_refused() -> None:
    bare = [TransportAddress(tp_rank=0, meta={"kind": "memory"})]
    with pytest.raises(LocationError, match="tp rank 0 address: remote address has no 'regions' list"):
        ready_location(bare, 1, 2)

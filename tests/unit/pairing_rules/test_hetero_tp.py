"""The block-layout math of heterogeneous TP over sharded (GQA) KV (`pdgate.pairing`): which rank holds which
KV heads, and what byte ranges of which prefill rank's block a decode rank reads. Checked against a brute
force: build each rank's block from the full per-head data, apply the reads, compare with the decode rank's
own block. (Pure math on CPU; no transport yet executes these reads.)"""

from __future__ import annotations

import pytest

from pdgate.pairing import HeadRead, head_reads, hetero_tp_fits, rank_heads

HEAD_BYTES = 8


def block(rank: int, kv_heads: int, tp: int) -> bytes:
    """A rank's block: its heads outermost, head h filled with the byte value h."""
    return b"".join(bytes([h]) * HEAD_BYTES for h in rank_heads(rank, kv_heads, tp))


@pytest.mark.parametrize(
    ("kv_heads", "tp", "want"),
    [
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (8, 1, [range(0, 8)]),
        (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated: tp/H ranks per head
    ],
)
def test_rank_heads_follow_vllms_sharding(kv_heads: int, tp: int, want: list[range]) -> None:
    assert [rank_heads(r, kv_heads, tp) for r in range(tp)] == want


def test_a_split_vllm_refuses_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        rank_heads(0, 6, 4)


@pytest.mark.parametrize(
    ("ptp", "dtp", "heads", "fits"),
    [
        (4, 2, 8, True),  # vllm-ascend's rule: P > D, P % D == 0
        (8, 2, 8, True),
        (4, 2, 2, True),  # P replicates heads: each D head is still whole on a P rank
        (2, 4, 8, True),  # the reverse, heads divide
        (1, 4, 4, True),
        (3, 2, 6, False),  # neither TP divides the other
        (4, 2, 6, False),  # vLLM cannot split 6 heads over 4 ranks
    ],
)
def test_which_tp_pairs_fit(ptp: int, dtp: int, heads: int, fits: bool) -> None:
    assert hetero_tp_fits(ptp, dtp, heads) is fits


@pytest.mark.parametrize(
    ("ptp", "dtp", "heads"), [(4, 2, 8), (8, 2, 8), (4, 1, 4), (4, 2, 2), (8, 4, 2), (2, 4, 8), (1, 4, 4), (2, 8, 4)]
)
def test_the_reads_rebuild_every_decode_ranks_block(ptp: int, dtp: int, heads: int) -> None:
    for d in range(dtp):
        want = block(d, heads, dtp)
        got = bytearray(len(want))
        for r in head_reads(d, ptp, dtp, heads, HEAD_BYTES):
            src = block(r.prefill_rank, heads, ptp)
            assert r.src_offset + r.nbytes <= len(src)
            got[r.dst_offset : r.dst_offset + r.nbytes] = src[r.src_offset : r.src_offset + r.nbytes]
        assert bytes(got) == want, (ptp, dtp, heads, d)


def test_p4_to_d2_gathers_two_whole_prefill_blocks_per_decode_rank() -> None:
    assert head_reads(1, 4, 2, 8, HEAD_BYTES) == [HeadRead(2, 0, 0, 16), HeadRead(3, 0, 16, 16)]


def test_p2_to_d4_reads_half_of_one_prefill_block() -> None:
    assert head_reads(1, 2, 4, 8, HEAD_BYTES) == [HeadRead(0, 16, 0, 16)]
    assert head_reads(2, 2, 4, 8, HEAD_BYTES) == [HeadRead(1, 0, 0, 16)]


def test_a_pair_that_does_not_fit_has_no_reads() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        head_reads(0, 3, 2, 6, HEAD_BYTES)

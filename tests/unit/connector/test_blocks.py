"""pdgate.connector.blocks: tokens to load, remote -> local block mapping, TP-rank mapping (pure)."""

from __future__ import annotations

import pytest
from pdgate.connector.blocks import BlockPlan, blocks_for_tokens, plan_pull, prompt_digest, tokens_to_load, tp_sources
from pdgate.connector.errors import BlockPlanError, TPLayoutError

from pdgate.errors import Code
from pdgate.models import TransportKind

NIXL, LLMDD = TransportKind.NIXL, TransportKind.LLMDATADIST


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (31, 1), (32, 1), (33, 2), (64, 2), (65, 3)])
def test_blocks_for_tokens(tokens: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, 32) == blocks


@pytest.mark.parametrize(
    ("prompt", "remote", "local_hit", "expected"),
    [
        (31, 31, 0, 31),  # less than one block: still loaded (the partial block is pulled)
        (32, 32, 0, 32),
        (33, 33, 0, 33),
        (33, 33, 32, 1),  # one cached block here, the partial tail block is pulled
        (64, 64, 32, 32),
        (65, 65, 64, 1),
        (40, None, 0, 40),  # the prefill did not say: the whole prompt
        (40, 41, 0, 40),  # a prefill that computed past the prompt covers only the prompt for us
        (40, 32, 0, 32),  # a prefill that covered less: load what it has, compute the rest
        (40, 32, 32, 0),  # ... nothing if that is all cached here already
    ],
)
def test_tokens_to_load(prompt: int, remote: int | None, local_hit: int, expected: int) -> None:
    assert tokens_to_load(prompt, remote, local_hit) == expected


def test_plan_without_local_hits_maps_in_order() -> None:
    assert plan_pull([7, 8, 9], [1, 2, 3], 0) == BlockPlan((7, 8, 9), (1, 2, 3))


def test_plan_skips_the_locally_cached_front() -> None:
    assert plan_pull([7, 8, 9], [5], 2) == BlockPlan((9,), (5,))


def test_plan_trims_an_extra_remote_block_at_the_tail_not_the_front() -> None:
    # The prefill reported one block past the prompt; the front still lines up with our table.
    assert plan_pull([7, 8, 9, 10], [1, 2, 3], 0) == BlockPlan((7, 8, 9), (1, 2, 3))


@pytest.mark.parametrize(("remote", "local", "hit"), [([7], [1, 2], 0), ([7, 8], [1, 2], 1), ([7], [], 0)])
def test_plan_refuses_counts_that_do_not_fit(remote: list[int], local: list[int], hit: int) -> None:
    with pytest.raises(BlockPlanError):
        plan_pull(remote, local, hit)


def test_tp_equal() -> None:
    assert tp_sources(4, 4, False, NIXL) == (0, 1, 2, 3)


def test_tp_prefill_larger_with_replicated_kv_spreads_over_prefill_ranks() -> None:
    assert tp_sources(4, 2, True, NIXL) == (0, 2)
    assert tp_sources(8, 1, True, LLMDD) == (0,)


def test_tp_unequal_with_sharded_kv_is_refused_with_the_reason() -> None:
    for ptp, dtp in ((4, 2), (2, 4)):
        with pytest.raises(TPLayoutError, match="not replicated") as info:
            tp_sources(ptp, dtp, False, NIXL)
        assert info.value.code is Code.TP_LAYOUT_UNSUPPORTED


def test_tp_decode_larger_with_replicated_kv_reads_shared_prefill_ranks_over_one_sided_reads() -> None:
    assert tp_sources(1, 2, True, NIXL) == (0, 0)
    assert tp_sources(2, 4, True, NIXL) == (0, 0, 1, 1)


def test_tp_decode_larger_is_refused_on_a_transport_that_needs_p_tp_ge_d_tp() -> None:
    with pytest.raises(TPLayoutError, match="llmdatadist needs P tp >= D tp"):
        tp_sources(1, 2, True, LLMDD)


def test_tp_sizes_below_one_are_refused() -> None:
    with pytest.raises(TPLayoutError, match=">= 1"):
        tp_sources(0, 1, True, NIXL)


def test_prompt_digest_names_the_tokens_the_kv_belongs_to() -> None:
    ids = list(range(100, 164))
    assert prompt_digest(ids, 64) == prompt_digest(list(ids), 64)
    assert prompt_digest([*ids, 9], 64) == prompt_digest(ids, 64)  # a prompt that continues after them
    assert prompt_digest(ids, 63) != prompt_digest(ids, 64)
    assert prompt_digest([*ids[:-1], 7], 64) != prompt_digest(ids, 64)
    assert prompt_digest(ids[:10], 64) is None and prompt_digest(None, 64) is None and prompt_digest(ids, 0) is None

"""Block bookkeeping for a pull: how many prompt tokens to load, which remote block fills which local
block, and which prefill TP rank each decode TP rank reads from. Pure functions, no vLLM, no I/O.

How many tokens the decode loads (the off-by-one, decided here once):

* The prefill ran the whole prompt of N tokens with max_tokens=1, so its KV covers positions 0..N-1
  (the sampled token's KV is never computed). It reports `num_tokens = min(num_computed, N)` and the
  `ceil(num_tokens / block_size)` blocks holding them, the last one possibly partial.
* The decode asks to load `covered - local_hit` tokens, where `covered = min(num_tokens, N)` and
  `local_hit` is the block-aligned local prefix-cache hit vLLM passes in. vLLM then sets
  `num_computed_tokens = N` and, once the load is reported, rewinds it to N-1 and recomputes the last
  prompt token to sample the first output token (`_update_waiting_for_remote_kv`).
* So the decode pulls every block the prefill wrote, the partial last block included: positions
  0..N-2 come bit-for-bit from the prefill's forward (the same computation a single instance does),
  and position N-1 is rewritten by the decode's own recompute. Pulling only full blocks would instead
  make the decode recompute up to block_size-1 tail tokens in a second prefill chunk, which is extra
  work and no closer to a single instance. Hence "whole prompt, partial block included".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BlockPlan",
    "BlockPlanError",
    "TPLayoutError",
    "blocks_for_tokens",
    "plan_pull",
    "tokens_to_load",
    "tp_sources",
]


class BlockPlanError(ValueError):
    """The prefill's blocks cannot fill the decode's blocks (counts disagree)."""

    code = "pd_block_plan_invalid"


class TPLayoutError(ValueError):
    """The prefill's and decode's tensor-parallel layouts cannot be mapped onto each other."""

    code = "pd_tp_layout_unsupported"


@dataclass(frozen=True)
class BlockPlan:
    """`remote_block_ids[i]` of the prefill is copied into `local_block_ids[i]` of the decode."""

    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return -(-max(num_tokens, 0) // block_size)


def tokens_to_load(num_prompt_tokens: int, remote_num_tokens: int | None, num_computed_tokens: int) -> int:
    """Prompt tokens the decode loads asynchronously beyond its local (block-aligned) hit; see module doc."""
    covered = num_prompt_tokens if remote_num_tokens is None else min(remote_num_tokens, num_prompt_tokens)
    return max(covered - num_computed_tokens, 0)


def plan_pull(remote_block_ids: Sequence[int], local_block_ids: Sequence[int], num_local_hit_blocks: int) -> BlockPlan:
    """Map the prefill's blocks onto the decode's newly allocated blocks.

    The decode's block table is `[local hits][new blocks]`; the first `num_local_hit_blocks` remote
    blocks hold tokens the decode already has, so they are skipped (trimming from the *front* by the
    hit count, not from the tail: the prefill may report one block more than the prompt needs when it
    computed a token past the prompt).
    """
    if num_local_hit_blocks < 0:
        raise BlockPlanError(f"negative local hit count {num_local_hit_blocks}")
    need = len(local_block_ids)
    if need == 0:
        raise BlockPlanError("no local blocks to fill")
    available = len(remote_block_ids) - num_local_hit_blocks
    if available < need:
        raise BlockPlanError(
            f"the prefill recorded {len(remote_block_ids)} blocks; {num_local_hit_blocks} are cached here "
            f"and {need} must be pulled, so {need - max(available, 0)} are missing"
        )
    start = num_local_hit_blocks
    return BlockPlan(tuple(remote_block_ids[start : start + need]), tuple(local_block_ids))


def tp_sources(prefill_tp: int, decode_tp: int, kv_replicated: bool) -> tuple[int, ...]:
    """The prefill TP rank each decode TP rank pulls from (index = decode rank).

    Equal TP: rank r reads rank r (each holds the same heads). Prefill TP > decode TP works only when the
    KV is replicated on every rank (MLA): then any prefill rank has all of it, and decode ranks are spread
    over the prefill ranks. Everything else would need re-sharding heads across ranks, which no transport
    here does, so it is refused with the reason.
    """
    if prefill_tp < 1 or decode_tp < 1:
        raise TPLayoutError(f"tensor-parallel sizes must be >= 1 (prefill {prefill_tp}, decode {decode_tp})")
    if prefill_tp == decode_tp:
        return tuple(range(decode_tp))
    if prefill_tp > decode_tp:
        if not kv_replicated:
            raise TPLayoutError(
                f"prefill tp {prefill_tp} > decode tp {decode_tp} needs KV replicated on every TP rank (MLA); "
                "this model's KV is sharded by head, so one decode rank would need several prefill shards"
            )
        return tuple(r * prefill_tp // decode_tp for r in range(decode_tp))
    raise TPLayoutError(
        f"prefill tp {prefill_tp} < decode tp {decode_tp} is not supported: each decode rank would need a slice "
        "of one prefill rank's heads; use equal TP, or a larger prefill TP with an MLA model"
    )

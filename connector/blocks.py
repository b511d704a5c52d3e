"""Block bookkeeping for a pull: how many prompt tokens to load, which remote block fills which local
block, and which prefill TP rank each decode TP rank reads from (the TP rule itself is
`pdgate.contract`'s, which the router applies too); with sharded KV at unequal TP, which bytes of which
prefill rank's blocks (`hetero_reads`). Pure functions, no vLLM, no I/O.

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
* A decode whose prompt is the prefill's plus the prefill's first output token (the router streamed that
  token itself, `pdgate.router.first_token`) has N+1 prompt tokens: it loads all N the prefill covers and
  computes position N, the one position the classic path computed too.

Which tokens the KV belongs to: the prefill sends a digest of the N prompt token ids it computed
(`prompt_digest`), and a decode loads that KV only when its own prompt starts with the same N tokens.
Positions hold keys and values of one text: loaded under another prompt they would give output that
differs from a single instance's, silently, which is the failure PD must never have.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdgate.connector.errors import BlockPlanError, TPLayoutError
from pdgate.connector.transport.base import KVRegion

from pdgate.contract import head_reads, hetero_tp_fits, rank_heads, source_rank, tp_mismatch
from pdgate.models import TransportKind

__all__ = [
    "BlockPlan",
    "SubBlockRead",
    "blocks_for_tokens",
    "hetero_reads",
    "plan_pull",
    "prompt_digest",
    "tokens_to_load",
    "tp_sources",
]


@dataclass(frozen=True)
class BlockPlan:
    """`remote_block_ids[i]` of the prefill is copied into `local_block_ids[i]` of the decode."""

    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return -(-max(num_tokens, 0) // block_size)


def prompt_digest(token_ids: Sequence[int] | None, num_tokens: int) -> str | None:
    """The digest of a prompt's first `num_tokens` token ids (module doc); None when there are fewer (or
    none: a prompt given as embeddings)."""
    if token_ids is None or num_tokens <= 0 or len(token_ids) < num_tokens:
        return None
    ids = token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens]
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


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


def tp_sources(
    prefill_tp: int, decode_tp: int, kv_replicated: bool, transport: TransportKind | None
) -> tuple[int, ...]:
    """The prefill TP rank each decode TP rank pulls from (index = decode rank), by the contract's rule.

    Equal TP: rank r reads rank r. With KV replicated on every rank (MLA) any TP pair works, decode rank
    r reading prefill rank r * P_tp // D_tp, except that a transport in `TP_GE_TRANSPORTS` needs
    P tp >= D tp. Sharded KV with unequal TP is refused with the reason (`TPLayoutError`): a decode rank
    then reads several prefill ranks' parts of blocks (`hetero_reads`), not one rank's blocks.
    """
    if prefill_tp < 1 or decode_tp < 1:
        raise TPLayoutError(f"tensor-parallel sizes must be >= 1 (prefill {prefill_tp}, decode {decode_tp})")
    refused = tp_mismatch(prefill_tp, decode_tp, kv_replicated=kv_replicated, transport=transport)
    if refused is not None:
        raise TPLayoutError(refused.describe())
    return tuple(source_rank(r, prefill_tp, decode_tp) for r in range(decode_tp))


class SubBlockRead(NamedTuple):
    """`nbytes` at address `src_addr` of prefill TP rank `prefill_rank` go to `dst_addr` of this decode rank."""

    prefill_rank: int
    src_addr: int
    dst_addr: int
    nbytes: int


def hetero_reads(
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    plan: BlockPlan,
    prefill_regions: Mapping[int, Sequence[KVRegion]],
    local_regions: Sequence[KVRegion],
) -> list[SubBlockRead]:
    """The byte ranges decode rank `decode_rank` pulls for `plan` when the KV is sharded over unequal TPs.

    Per region (the same layers on every rank, matched by position and name) and per block pair, each run of
    heads `pdgate.contract.head_reads` assigns to a prefill rank becomes one range; a block keeps its heads
    outermost, so a rank's block is `heads x head_bytes` and a head is one contiguous run. Reads are grouped
    by prefill rank (one peer's ranges together, as a transport submits them) and merged where both sides
    continue each other (whole blocks of consecutive ids, or one rank's heads spanning blocks).
    `prefill_regions`: each prefill rank's registered regions, from the address it advertised.
    """
    if not hetero_tp_fits(prefill_tp, decode_tp, kv_heads):
        raise TPLayoutError(
            f"tp {prefill_tp} -> {decode_tp} with {kv_heads} KV heads cannot be re-cut into whole heads"
        )
    mine = len(rank_heads(decode_rank, kv_heads, decode_tp))
    reads = head_reads(decode_rank, prefill_tp, decode_tp, kv_heads, 1)  # offsets in heads, scaled per region
    head_bytes = [_head_bytes(r, mine, "this decode rank") for r in local_regions]
    by_rank: dict[int, list[SubBlockRead]] = {}
    for hr in reads:
        regions = _peer_regions(hr.prefill_rank, prefill_regions, local_regions, head_bytes, kv_heads, prefill_tp)
        out = by_rank.setdefault(hr.prefill_rank, [])
        for src_region, dst_region, hb in zip(regions, local_regions, head_bytes, strict=True):
            for s, d in zip(plan.remote_block_ids, plan.local_block_ids, strict=True):
                src = src_region.block_addr(s) + hr.src_offset * hb
                dst = dst_region.block_addr(d) + hr.dst_offset * hb
                _append(out, SubBlockRead(hr.prefill_rank, src, dst, hr.nbytes * hb))
    return [read for rank in sorted(by_rank) for read in by_rank[rank]]


def _head_bytes(region: KVRegion, heads: int, whose: str) -> int:
    if region.block_len % heads:
        raise TPLayoutError(
            f"{whose}'s region {region.name!r} has {region.block_len} B blocks, not {heads} whole heads"
        )
    return region.block_len // heads


def _peer_regions(
    rank: int,
    prefill_regions: Mapping[int, Sequence[KVRegion]],
    local: Sequence[KVRegion],
    head_bytes: Sequence[int],
    kv_heads: int,
    prefill_tp: int,
) -> Sequence[KVRegion]:
    """Prefill rank `rank`'s regions, checked to be ours with its own head count per block."""
    regions = prefill_regions.get(rank)
    if not regions:
        raise TPLayoutError(f"the prefill advertised no KV regions for tp rank {rank}")
    if len(regions) != len(local):
        raise TPLayoutError(f"prefill tp rank {rank} registered {len(regions)} KV regions, this decode {len(local)}")
    held = len(rank_heads(rank, kv_heads, prefill_tp))
    for theirs, ours, hb in zip(regions, local, head_bytes, strict=True):
        if theirs.name != ours.name or theirs.block_len != held * hb:
            raise TPLayoutError(
                f"prefill tp rank {rank}'s region {theirs.name!r} has {theirs.block_len} B blocks; "
                f"{ours.name!r} of {held} heads of {hb} B was expected"
            )
    return regions


def _append(out: list[SubBlockRead], read: SubBlockRead) -> None:
    """Add `read`, merged into the last one when it continues it on both sides."""
    if out:
        last = out[-1]
        if last.src_addr + last.nbytes == read.src_addr and last.dst_addr + last.nbytes == read.dst_addr:
            out[-1] = last._replace(nbytes=last.nbytes + read.nbytes)
            return
    out.append(read)

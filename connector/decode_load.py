"""What a decode request loads: its `kv_transfer_params`, the blocks to fill, and whether the load may be
synchronous. Pure functions over vLLM's objects read duck-typed; `scheduler_decode.py` acts on them.

The synchronous load (`sync_load_when_idle`): under the router's claim, on an engine with no other
request (nothing else to hold up), the scheduler half answers vLLM "not async" with one token fewer than
the prompt, so vLLM schedules the request's last prompt token in the very step that allocates its
blocks, and the worker pulls in `start_load_kv`, before that forward (`RecvPlan.sync`). The
asynchronous path costs one whole engine step more at low load: the step that allocates and pulls, its
output back to the engine core, vLLM's 1 ms pause after a step that computed nothing, and only then the
forward. It needs the whole prompt from the prefill, the location in the params and a sealed claim for
this instance: no ledger round trip may stand between allocation and the forward. Siblings (n > 1)
always load asynchronously.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdgate.connector.blocks import blocks_for_tokens, prompt_digest
from pdgate.connector.config import ConnectorConfig

from pdgate.contract import KVTransferParams

__all__ = ["blocks_to_fill", "may_load_sync", "read_decode_params", "same_prompt"]


def read_decode_params(params: Mapping[str, Any]) -> KVTransferParams:
    """A decode's `kv_transfer_params`, with what it cannot work without (the handoff id, one KV group)."""
    kv = KVTransferParams.parse(params)
    kv.require_transfer_id()
    kv.block_ids()
    return kv


def same_prompt(prompt_token_ids: Any, kv: KVTransferParams) -> bool:
    """Whether the decode's prompt starts with the tokens whose KV the prefill holds (`connector.blocks`):
    a prefill that sent no digest (an older one, a simulator) is taken at its word."""
    want = kv.remote_prompt_digest
    if want is None or kv.remote_num_tokens is None:
        return True
    return prompt_digest(prompt_token_ids, kv.remote_num_tokens) == want


def may_load_sync(
    cfg: ConnectorConfig, kv: KVTransferParams, *, instance_id: str, claim_key: bytes | None, whole_prompt: bool
) -> bool:
    """Whether this load may be synchronous (module doc); `whole_prompt`: the prefill covers every prompt
    token beyond the local hit but the last one at most, so vLLM computes only the last one."""
    return (
        cfg.sync_load_when_idle
        and whole_prompt
        and (kv.siblings or 1) == 1
        and kv.kv_key is not None
        and kv.location() is not None
        and kv.trusted_until(instance_id, claim_key) is not None
    )


def blocks_to_fill(
    group: Any, num_external_tokens: int, block_size: int, sync_local_hit: int | None
) -> tuple[int, tuple[int, ...]]:
    """(local hit blocks, ids of the blocks the pull fills) in a request's first KV group.

    Asynchronous: vLLM caches the new blocks only once the load is reported, so the hit is the run of
    hashed blocks at the front and the blocks to fill are the unhashed ones. Synchronous
    (`sync_local_hit`: the block-aligned local hit vLLM passed in): vLLM caches the new blocks at
    allocation, so the hashes no longer tell them apart and the counts do.
    """
    if sync_local_hit is not None:
        hit = sync_local_hit // block_size
        end = blocks_for_tokens(sync_local_hit + num_external_tokens, block_size)
        return hit, tuple(b.block_id for b in group[hit:end])
    hit = 0
    for block in group:
        if block.block_hash is None or block.is_null:
            break
        hit += 1
    return hit, tuple(b.block_id for b in group if b.block_hash is None and not b.is_null)

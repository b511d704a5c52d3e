"""The KV location: what a prefill records in the ledger, and what a decode checks before pulling from it.

Both ends of the same record live here so that one reading shows the whole exchange between a prefill
and a decode engine: `location_for` writes the `KVLocation` a prefill marks READY with, and
`plan_from_location` is the decode's side. Before a byte moves it applies the P/D compatibility rule of
`pdgate.contract` (the one the router pairs with) to the location and this engine, then checks
what only the location can tell (every source rank advertised, enough blocks), and refuses with a
`LocationError` whose code and sentence say why. Pure: `EngineFacts` in, `KVLocation` / `RecvPlan` out.
`prefill_regions` reads each prefill rank's KV regions out of the location, what a decode at another TP
plans its sub-block reads with (`blocks.hetero_reads`).
The scheduler half (`scheduler.py`) owns the state around them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.connector.blocks import blocks_for_tokens, plan_pull, tp_sources
from pdgate.connector.errors import BlockPlanError, ConfigError, LocationError, TPLayoutError
from pdgate.connector.metadata import RecvPlan, address_from_model, address_to_model
from pdgate.connector.transport.base import KVRegion, regions_from_address
from pdgate.connector.transport.errors import InvalidPull

from pdgate.contract import KVFacts, mismatch
from pdgate.errors import Code
from pdgate.models import Handoff, KVLocation, TransportAddress, TransportKind

__all__ = [
    "EngineFacts",
    "addresses_from_workers",
    "location_for",
    "plan_for",
    "plan_from_location",
    "prefill_regions",
]


@dataclass(frozen=True)
class EngineFacts:
    """What this engine is, as the KV location and the registry describe it."""

    instance_id: str
    engine_id: str | None
    host: str | None
    dp_rank: int
    tp_size: int
    world_size: int  # workers that each report every finished transfer (vLLM's aggregator count)
    block_size: int
    kv_dtype: str
    kv_layout: str
    kv_replicated: bool
    transport: str

    def shape(self) -> KVFacts:
        """This engine as the compatibility rule sees it."""
        return KVFacts(
            block_size=self.block_size,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            transport=TransportKind(self.transport),
            tp_size=self.tp_size,
            kv_replicated=self.kv_replicated,
        )


def addresses_from_workers(addresses: Mapping[int, Mapping[str, Any]]) -> list[TransportAddress]:
    """The workers' `Transport.local_address()` by TP rank, as the contract's `TransportAddress` list.

    Two ranks with one llm_datadist cluster id would be one cluster to every peer (a rank table with a
    duplicate, or one `PDGATE_DEVICE_IP` shared by several devices): refused here, at engine start.
    """
    models = [address_to_model(rank, addr) for rank, addr in sorted(addresses.items())]
    seen: dict[int, int] = {}
    for a in models:
        if a.cluster_id is None:
            continue
        if a.cluster_id in seen:
            raise ConfigError(
                f"tp ranks {seen[a.cluster_id]} and {a.tp_rank} share llm_datadist cluster id {a.cluster_id} "
                f"(device IP {a.device_ip}); every device needs its own IP"
            )
        seen[a.cluster_id] = a.tp_rank
    return models


def location_for(
    facts: EngineFacts,
    *,
    block_ids: Sequence[int],
    num_tokens: int,
    addresses: Sequence[TransportAddress],
    remote_request_id: str,
) -> tuple[KVLocation, list[int]]:
    """The READY record of a finished prefill, and the blocks it advertises (those holding the prompt)."""
    kept = list(block_ids[: blocks_for_tokens(num_tokens, facts.block_size)])
    location = KVLocation(
        block_ids=[kept],
        num_tokens=num_tokens,
        engine_id=facts.engine_id,
        host=facts.host,
        dp_rank=facts.dp_rank,
        tp_size=facts.tp_size,
        block_size=facts.block_size,
        kv_dtype=facts.kv_dtype,
        kv_layout=facts.kv_layout,
        transport=TransportKind(facts.transport),
        transport_addresses=list(addresses),
        remote_request_id=remote_request_id,
    )
    return location, kept


def plan_from_location(
    handoff: Handoff,
    facts: EngineFacts,
    *,
    req_id: str,
    local_block_ids: Sequence[int],
    hit_blocks: int,
) -> RecvPlan:
    """The pull every decode worker runs for a claimed handoff, or `LocationError` saying why not."""
    if handoff.location is None:
        raise LocationError("the handoff carries no KV location")
    return plan_for(
        handoff.location,
        facts,
        transfer_id=handoff.transfer_id,
        kv_key=handoff.kv_key,
        req_id=req_id,
        local_block_ids=local_block_ids,
        hit_blocks=hit_blocks,
    )


def plan_for(
    loc: KVLocation,
    facts: EngineFacts,
    *,
    transfer_id: str,
    kv_key: int,
    req_id: str,
    local_block_ids: Sequence[int],
    hit_blocks: int,
) -> RecvPlan:
    """The pull for one location: the ledger's (claimed), or the prefill's copy in the params (early)."""
    decode = facts.shape()
    # The location does not say whether the prefill's KV is replicated; it is the same model, so ours does.
    prefill = KVFacts(
        block_size=loc.block_size,
        kv_dtype=loc.kv_dtype,
        kv_layout=loc.kv_layout,
        transport=loc.transport,
        tp_size=loc.tp_size,
        kv_replicated=facts.kv_replicated,
    )
    refused = mismatch(prefill, decode)
    if refused is not None:
        code = Code.TP_LAYOUT_UNSUPPORTED if refused.field == "tp_size" else Code.LOCATION_MISMATCH
        raise LocationError(refused.describe("the prefill", "this decode"), code=code)
    if not loc.block_ids:
        raise LocationError("the handoff lists no blocks")
    try:
        ranks = tp_sources(loc.tp_size, facts.tp_size, facts.kv_replicated, decode.transport)
        by_rank = {a.tp_rank: a for a in loc.transport_addresses}
        missing = [r for r in ranks if r not in by_rank]
        if missing:
            raise LocationError(f"the prefill advertised no transport address for tp rank(s) {missing}")
        plan = plan_pull(loc.block_ids[0], local_block_ids, hit_blocks)
    except (TPLayoutError, BlockPlanError) as exc:
        raise LocationError(exc.message, code=exc.code) from None
    sources = tuple(address_from_model(by_rank[r]) for r in ranks)
    return RecvPlan(req_id, transfer_id, kv_key, plan.remote_block_ids, plan.local_block_ids, sources)


def prefill_regions(loc: KVLocation) -> dict[int, list[KVRegion]]:
    """Each prefill TP rank's registered KV regions, from the address it advertised in `loc` (its
    `Transport.local_address()`); `LocationError` when one carries none or a malformed list."""
    out: dict[int, list[KVRegion]] = {}
    for a in loc.transport_addresses:
        try:
            out[a.tp_rank] = regions_from_address(address_from_model(a))
        except InvalidPull as exc:
            raise LocationError(f"the prefill's tp rank {a.tp_rank} address: {exc.message}") from None
    return out

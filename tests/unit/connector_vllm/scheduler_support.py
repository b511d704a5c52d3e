"""Builders shared by the scheduler-half tests: a `SchedulerHalf` on vLLM's objects, and the params,
handoffs and request endings the two sides see."""

from __future__ import annotations

from typing import Any

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.location import EngineFacts
from pdgate.connector.scheduler import SchedulerHalf
from vllm.v1.request import RequestStatus

from pdgate.claim_seal import claim_key
from pdgate.contract import RouterClaim, with_claim
from pdgate.models import Handoff, HandoffState, KVLocation, TransportAddress, TransportKind
from tests.unit.connector_vllm.conftest import BLOCK_SIZE

LAYOUT = "LBHNC/bfloat16/L2/H2/D32/B32"
TOKEN = "scheduler-test-token"  # the metaserver admin token of `cfg()`: the router's claims are sealed with it


def cfg(**over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url="http://127.0.0.1:1",
        instance_id="node-a",
        url="http://127.0.0.1:8100",
        model="tiny",
        role="both",
        kv_lease_s=30.0,
        free_margin_s=10.0,
        ready_wait_s=30.0,
        pull_timeout_s=30.0,
        metaserver_token=TOKEN,
    )
    base.update(over)
    return ConnectorConfig(**base)


def half(*, world_size: int = 1, tp_size: int = 1, replicated: bool = False, **over: Any) -> SchedulerHalf:
    facts = EngineFacts(
        instance_id="node-a",
        engine_id="engine-a",
        host="127.0.0.1",
        dp_rank=0,
        tp_size=tp_size,
        world_size=world_size,
        block_size=BLOCK_SIZE,
        kv_dtype="bfloat16",
        kv_layout=LAYOUT,
        kv_replicated=replicated,
        transport="nixl",
    )
    h = SchedulerHalf(cfg(**over), facts)
    h.set_addresses(
        {r: {"kind": "nixl", "agent_name": f"a-tp{r}", "agent_metadata": "QQ==", "regions": []} for r in range(tp_size)}
    )
    return h


def router_claimed(
    params: dict[str, Any], claimed_by: str = "node-a", deadline: float = 1000.0, token: str = TOKEN
) -> dict[str, Any]:
    """`params` with the claim the router makes for `claimed_by` (a 10 s lease), sealed as the router seals it."""
    claim = RouterClaim(claimed_by, deadline, 10.0).sealed(
        claim_key(token), transfer_id=params["transfer_id"], location=params.get("remote_location")
    )
    return with_claim(params, claim)


def d_params(tid: str = "t-1", num_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid}
    if num_tokens is not None:
        p["remote_num_tokens"] = num_tokens
    p.update(extra)
    return p


def early_params(tid: str = "t-1", location: Any = None, **extra: Any) -> dict[str, Any]:
    """A decode's params carrying the prefill's READY record (`remote_location`), for the early pull;
    `location`: another record (or a raw dict) than the one `handoff(tid, [7, 8], num_tokens=40)` holds."""
    loc = location if location is not None else handoff(tid, [7, 8], num_tokens=40).location
    dumped = loc.model_dump(mode="json", exclude_none=True) if isinstance(loc, KVLocation) else loc
    return d_params(tid, num_tokens=40, kv_key=9, remote_location=dumped, **extra)


def router_params(
    tid: str = "t-1", claimed_by: str = "node-a", deadline: float = 1000.0, location: Any = None
) -> dict[str, Any]:
    """`early_params` with the router's sealed claim for `claimed_by`."""
    return router_claimed(early_params(tid, location), claimed_by, deadline)


def p_params(tid: str = "t-1", kv_key: int | None = 5) -> dict[str, Any]:
    p: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    if kv_key is not None:
        p["kv_key"] = kv_key
    return p


def handoff(tid: str, block_ids: list[int], *, num_tokens: int, tp_size: int = 1, **loc: Any) -> Handoff:
    location = KVLocation(
        block_ids=[block_ids],
        num_tokens=num_tokens,
        engine_id="engine-p",
        tp_size=tp_size,
        block_size=loc.pop("block_size", BLOCK_SIZE),
        kv_dtype="bfloat16",
        kv_layout=loc.pop("kv_layout", LAYOUT),
        transport=TransportKind.NIXL,
        transport_addresses=loc.pop(
            "addresses",
            [TransportAddress(tp_rank=r, meta={"kind": "nixl", "agent_name": f"p-tp{r}"}) for r in range(tp_size)],
        ),
    )
    return Handoff(
        transfer_id=tid,
        kv_key=9,
        state=HandoffState.CLAIMED,
        prefill_instance_id="p0",
        decode_instance_id="node-a",
        location=location,
        created_at=0.0,
        updated_at=0.0,
        lease_s=30.0,
    )


def finish(req: Any, status: RequestStatus, computed: int | None = None) -> None:
    req.status = status
    req.num_computed_tokens = req.num_prompt_tokens if computed is None else computed

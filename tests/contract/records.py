"""Records and helpers shared by the store contract suite (every test module here runs on every backend)."""

from __future__ import annotations

import time

from pdgate.metaserver.registry import new_instance
from pdgate.metaserver.store import Store

from pdgate.models import (
    Handoff,
    HandoffCreate,
    HandoffState,
    Instance,
    InstanceRegistration,
    KVLocation,
    Role,
    TransportAddress,
)

S = HandoffState
PENDING_LEASE = 60.0
READY_LEASE = 30.0
LOC = KVLocation(
    block_ids=[[3, 4, 5], [9]],
    num_tokens=40,
    engine_id="eng-0",
    host="10.0.0.5",
    dp_rank=1,
    tp_size=2,
    block_size=16,
    transport_addresses=[TransportAddress(tp_rank=0, host="10.0.0.5", port=5600, meta={"agent": "a0", "n": [1, 2]})],
    remote_request_id="cmpl-abc-0",
)


def t0() -> float:
    return time.time()


async def create(store: Store, tid: str, now: float, prefill: str = "p0", lease_s: float | None = None) -> Handoff:
    body = HandoffCreate(prefill_instance_id=prefill, transfer_id=tid, lease_s=lease_s, request_id=f"req-{tid}")
    return await store.create_handoff(
        body, transfer_id=tid, now=now, pending_lease_s=PENDING_LEASE, ready_lease_s=READY_LEASE
    )


async def claimed(store: Store, tid: str, now: float, decode: str = "d0", prefill: str = "p0") -> Handoff:
    await create(store, tid, now, prefill)
    await store.mark_ready(tid, LOC, now=now)
    return (await store.claim(tid, decode, now=now, lease_s=5.0)).handoff


def reg(iid: str = "p0", role: Role = Role.PREFILL, **kw: object) -> InstanceRegistration:
    data: dict[str, object] = {"id": iid, "role": role, "url": "http://10.0.0.5:8100", "model": "m"}
    data.update(kw)
    return InstanceRegistration.model_validate(data)


async def register(store: Store, r: InstanceRegistration, now: float, lease: float = 10.0) -> Instance:
    return await store.register(new_instance(r, now=now, default_lease_s=lease), now=now)

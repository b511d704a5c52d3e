"""READYs as a TP 8 NIXL prefill sends them, through the connector's own `Batcher`, over a real client.

Shared by the integration test of the batcher's byte cap (`test_batch_bytes`) and the hostile-input
case in `tests/security/test_ledger_batch_bytes.py`: one READY carrying NIXL-like agent metadata for 8
TP ranks is about 66 KB, so 24 of them in one batch passed the metaserver's 1 MiB body limit (issue #21,
finding 4). `ready_through_batcher` records what each request carried, so a test can say how the
batcher cut the calls, not only that they landed."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdgate.batcher import Batcher
from pdgate.meta_client import MetaClient, MetaError
from pdgate.models import (
    BatchBody,
    BatchItem,
    BatchReady,
    Handoff,
    HandoffCreate,
    KVLocation,
    TransportAddress,
    TransportKind,
)

__all__ = ["HANDOFFS", "TP", "Sent", "body_bytes", "create_handoffs", "nixl_location", "ready_through_batcher"]

HANDOFFS = 64  # concurrent handoffs, as the issue asks
TP = 8
_RANK_META = 3000  # raw bytes of agent metadata per rank, twice over (base64: ~8 KB a rank, ~66 KB a READY)


def nixl_location(prefill: str, salt: int, *, rank_meta: int = _RANK_META) -> KVLocation:
    """What a TP 8 NIXL prefill records: per rank, its agent's address and opaque metadata."""
    ranks = [
        TransportAddress(
            tp_rank=r,
            host="10.0.0.7",
            port=5600 + r,
            meta={
                "agent": f"{prefill}-tp{r}",
                "agent_metadata": base64.b64encode(bytes([salt, r]) * rank_meta).decode(),
            },
        )
        for r in range(TP)
    ]
    return KVLocation(
        block_ids=[list(range(salt, salt + 64))],
        num_tokens=1000,
        engine_id=prefill,
        tp_size=TP,
        transport=TransportKind.NIXL,
        transport_addresses=ranks,
    )


def body_bytes(items: Sequence[BatchItem]) -> int:
    """The body `MetaClient.batch` sends for `items`."""
    return len(BatchBody(items=list(items)).model_dump_json(exclude_none=True))


async def create_handoffs(client: MetaClient, prefill: str, n: int = HANDOFFS) -> list[Handoff]:
    return list(
        await asyncio.gather(*(client.create_handoff(HandoffCreate(prefill_instance_id=prefill)) for _ in range(n)))
    )


@dataclass
class Sent:
    """Per call, its outcome (the record, or the error its caller got); per request, the items it carried."""

    outcomes: list[Handoff | BaseException] = field(default_factory=list)
    requests: list[list[BatchItem]] = field(default_factory=list)

    def bodies(self) -> list[int]:
        return [body_bytes(items) for items in self.requests]


async def ready_through_batcher(client: MetaClient, items: Sequence[BatchReady]) -> Sent:
    """Every READY at once through one `Batcher` (as the connector builds it) over `client`."""
    sent = Sent()

    async def send(batch: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        sent.requests.append(list(batch))
        return await client.batch(batch)

    batcher = Batcher(send, max_in_flight=2)  # as `connector.control` builds it (its _MAX_IN_FLIGHT)
    sent.outcomes = list(await asyncio.gather(*(batcher.call(item) for item in items), return_exceptions=True))
    await batcher.aclose()
    return sent

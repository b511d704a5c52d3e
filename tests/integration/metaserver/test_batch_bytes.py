"""Ledger batches are capped in bytes as well as in items (issue #21, finding 4), over a real metaserver.

One READY carrying NIXL-like agent metadata for 8 TP ranks is about 66 KB: alone it lands, but 24 of them
in one batch passed the metaserver's 1 MiB body limit and all got 413. Here 64 handoffs go READY at once
through the connector's own `Batcher` over the client; every READY must land, in requests under the limit.
And a metaserver configured below the default limit (the batcher cannot know it) answers 413: the client
splits the batch and sends the halves, so a 413 is never the items' fate."""

from __future__ import annotations

from pdgate.meta_client import MetaClient
from pdgate.models import MAX_BODY_BYTES, BatchReady, Handoff, HandoffState
from tests.integration.metaserver.conftest import ServeMeta
from tests.integration.metaserver.nixl_ready import (
    HANDOFFS,
    body_bytes,
    create_handoffs,
    nixl_location,
    ready_through_batcher,
)
from tests.support.meta import uid


async def ready_all(url: str) -> tuple[list[Handoff | BaseException], list[int]]:
    """Every READY through one `Batcher` over the client; also the body size of each batch it sent."""
    async with MetaClient(url, timeout=30.0) as client:
        prefill = uid("p")
        created = await create_handoffs(client, prefill)
        items = [
            BatchReady(transfer_id=h.transfer_id, location=nixl_location(prefill, i)) for i, h in enumerate(created)
        ]
        one = body_bytes([items[0]])
        assert 60_000 < one < MAX_BODY_BYTES // 8  # the size the issue measured, far under the limit alone
        sent = await ready_through_batcher(client, items)
        return sent.outcomes, sent.bodies()


async def test_64_tp8_readies_at_once_all_land_in_requests_under_the_body_limit(serve_meta: ServeMeta) -> None:
    server = serve_meta()
    ready, bodies = await ready_all(server.url)
    assert [getattr(h, "state", h) for h in ready] == [HandoffState.READY] * HANDOFFS
    # 64 x ~66 KB is ~4 MiB: several requests, each under the limit (one would have been refused whole).
    assert len(bodies) >= 4 and max(bodies) <= MAX_BODY_BYTES


async def test_a_413_from_a_metaserver_with_a_lower_limit_is_split_not_the_items_fate(serve_meta: ServeMeta) -> None:
    server = serve_meta(max_body_bytes=256 * 1024)  # the batcher sizes for the default (1 MiB): every batch 413s
    ready, _ = await ready_all(server.url)
    assert [getattr(h, "state", h) for h in ready] == [HandoffState.READY] * HANDOFFS

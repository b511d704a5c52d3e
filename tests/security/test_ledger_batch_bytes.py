"""A deployment's READYs are never refused for their size in bulk (issue #21, finding 4), served as shipped.

One READY carrying NIXL-like agent metadata for 8 TP ranks is about 66 KB: 24 of them in one batch passed
the metaserver's 1 MiB body limit and every one got 413, through the connector's own `Batcher`. Here 64
such handoffs go READY at once against a metaserver served the way `pdgate-metaserver` serves it (the
guarded protocol answers 413 from the Content-Length, before reading the body), on memory and on redis.
And one READY larger than any request may be (a prefill whose descriptors alone pass the limit) rides
among them: it goes in a request of its own and gets its own typed 413, and none of the others fails
with it. The READY helpers are the integration test's (`tests/integration/metaserver/nixl_ready.py`)."""

from __future__ import annotations

from pdgate.meta_client import MetaBadRequest, MetaClient
from pdgate.models import MAX_BODY_BYTES, META_MAX_STRING, BatchReady, HandoffState
from tests.integration.metaserver.nixl_ready import (
    HANDOFFS,
    TP,
    body_bytes,
    create_handoffs,
    nixl_location,
    ready_through_batcher,
)
from tests.security.conftest import Serve
from tests.support.meta import uid

# Raw bytes of agent metadata per rank that make a READY too large for any request, each rank's string
# still within the model's own bound: 8 ranks x ~200 KB of base64 is ~1.6 MB.
_HUGE_RANK_META = (META_MAX_STRING * 3 // 4) // 2 - 1024


async def test_64_tp8_readies_land_and_one_too_large_for_any_batch_fails_alone(serve: Serve) -> None:
    server = serve()
    async with MetaClient(server.url, timeout=30.0) as client:
        prefill = uid("p")
        created = await create_handoffs(client, prefill, HANDOFFS + 1)
        huge_at = HANDOFFS // 2  # in the middle of the burst, so the batcher has to cut around it
        items = [
            BatchReady(
                transfer_id=h.transfer_id,
                location=nixl_location(prefill, i, **({"rank_meta": _HUGE_RANK_META} if i == huge_at else {})),
            )
            for i, h in enumerate(created)
        ]
        huge = items[huge_at]
        assert 60_000 < body_bytes([items[0]]) < MAX_BODY_BYTES // 8  # the 66 KB
        assert body_bytes([huge]) > MAX_BODY_BYTES and len(huge.location.transport_addresses) == TP

        sent = await ready_through_batcher(client, items)

        others = [o for i, o in enumerate(sent.outcomes) if i != huge_at]
        assert [getattr(o, "state", o) for o in others] == [HandoffState.READY] * HANDOFFS
        refused = sent.outcomes[huge_at]
        assert isinstance(refused, MetaBadRequest) and refused.status == 413, refused  # its own, typed
        assert [len(r) for r in sent.requests if huge in r] == [1]  # sent alone
        assert len(sent.requests) >= 5  # ~4 MiB of ordinary READYs need several requests
        assert max(body_bytes(r) for r in sent.requests if huge not in r) <= MAX_BODY_BYTES
        still = await client.get_handoff(huge.transfer_id)
        assert still.state is HandoffState.PENDING  # refused, not half-applied: its prefill can abort it

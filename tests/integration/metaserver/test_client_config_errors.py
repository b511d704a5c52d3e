"""A wrong admin token is a configuration error, not an outage (issue #21): over both transports, against a
real metaserver that requires a token, the client raises `MetaUnauthorized` (401), never the retryable
`MetaUnavailable` a caller treats as the metaserver being down."""

from __future__ import annotations

import pytest

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient, MetaUnauthorized, MetaUnavailable
from pdgate.meta_pooled import PooledMetaClient
from pdgate.models import HandoffCreate
from tests.integration.metaserver.conftest import ServeMeta


@pytest.mark.parametrize("kind", ["httpx", "pool"])
async def test_a_wrong_token_raises_unauthorized_not_unavailable(serve_meta: ServeMeta, kind: str) -> None:
    url = serve_meta(admin_token="right-token").url
    pool = HttpPool()
    client = (
        MetaClient(url, admin_token="wrong-token")
        if kind == "httpx"
        else PooledMetaClient(url, pool=pool, admin_token="wrong-token", owns_pool=True)
    )
    async with client:
        with pytest.raises(MetaUnauthorized) as raised:
            await client.create_handoff(HandoffCreate(prefill_instance_id="p-1"))
    assert not isinstance(raised.value, MetaUnavailable) and raised.value.status == 401
    assert not raised.value.retryable
    await pool.aclose()

"""`MetaClient` over a `pdgate.meta_transport.MetaTransport`: the client alone owns routes, query strings,
bodies and the typed errors; a transport only moves bytes. The fake here is a real implementation of the
seam (it answers what a metaserver would), as httpx's MockTransport is of httpx's."""

from __future__ import annotations

import orjson
import pytest

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaBadRequest, MetaClient, MetaUnauthorized, MetaUnavailable
from pdgate.meta_pooled import PooledMetaClient
from pdgate.meta_transport import MetaTransport
from pdgate.models import Role


class Canned:
    """Answers every request with one status and body, and records what it was sent."""

    def __init__(self, status: int, body: object) -> None:
        self.status = status
        self.body = orjson.dumps(body)
        self.sent: list[tuple[str, str, bytes | None, float]] = []
        self.closed = False

    @property
    def base_url(self) -> str:
        return "fake://meta"

    async def send(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        self.sent.append((method, path, body, timeout))
        return self.status, self.body

    async def aclose(self) -> None:
        self.closed = True


async def test_the_client_builds_the_path_query_and_timeout_and_closes_its_transport() -> None:
    fake = Canned(200, {"instances": []})
    seam: MetaTransport = fake
    async with MetaClient("ignored", transport=seam, timeout=2.0) as client:
        assert await client.list_instances(role=Role.DECODE, model="m") == []
    assert fake.sent == [("GET", "/v1/instances?role=decode&model=m", None, 2.0)]
    assert fake.closed and client.base_url == "fake://meta"


@pytest.mark.parametrize(
    ("status", "kind"),
    [(401, MetaUnauthorized), (403, MetaUnauthorized), (422, MetaBadRequest), (503, MetaUnavailable)],
)
async def test_an_answer_becomes_the_typed_error_of_its_status_whatever_the_transport(
    status: int, kind: type[Exception]
) -> None:
    fake = Canned(status, {"detail": "no", "code": "unauthorized" if status in (401, 403) else "validation_error"})
    client = MetaClient("ignored", transport=fake)
    with pytest.raises(kind) as raised:
        await client.drain("i-1")
    assert type(raised.value) is kind  # 401/403/422 are not MetaUnavailable: a wrong token is no outage


async def _pool_closed(pool: HttpPool) -> bool:
    """Whether `pool` refuses to send because it was closed (port 9: nothing listens, so an open pool fails
    to connect instead)."""
    with pytest.raises(MetaUnavailable) as raised:
        await PooledMetaClient("http://127.0.0.1:9", pool=pool, timeout=1.0).drain("i-1")
    return "pool is closed" in str(raised.value)


async def test_the_pooled_client_closes_a_pool_it_owns_and_leaves_one_it_was_lent() -> None:
    lent, owned = HttpPool(), HttpPool()
    await PooledMetaClient("http://127.0.0.1:9", pool=lent).aclose()
    await PooledMetaClient("http://127.0.0.1:9", pool=owned, owns_pool=True).aclose()
    assert not await _pool_closed(lent)
    assert await _pool_closed(owned)
    await lent.aclose()

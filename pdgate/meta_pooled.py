"""`PooledMetaClient`: a `MetaClient` over the router's `HttpPool` (`pdgate.meta_transport.PoolTransport`).

It is no longer a subclass: the client takes its HTTP layer as a transport and its batching as a
parameter (`pdgate.meta_client.MetaClient`, `batches`), and this factory keeps the name the router, the
simulator, the connector and the benches call. Why the pool (hot-path CPU), why the connection cap and
why batches: `PoolTransport`'s and `MetaClient`'s docstrings.

Batches (`batches`, --metaserver-batches): per client request the router makes two ledger calls (the
create before the prefill, the claim before the decode), so as single calls the metaserver cost the
router two of its four upstream round trips per request. A metaserver without the batch route (an older
one: 404) gets the batch's items as single calls, and every call after that goes single. READY and DONE
go the same way for `pdgate-sim`, which uses this client as an engine.
"""

from __future__ import annotations

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient
from pdgate.meta_transport import PoolTransport

__all__ = ["PooledMetaClient"]


def PooledMetaClient(  # the name callers used when this was a class
    base_url: str,
    *,
    pool: HttpPool,
    admin_token: str | None = None,
    timeout: float = 5.0,
    max_connections: int = 256,
    batches: int = 0,
    owns_pool: bool = False,
) -> MetaClient:
    """A `MetaClient` over `pool`; `owns_pool`: its `aclose()` closes the pool too."""
    transport = PoolTransport(
        base_url,
        pool,
        admin_token=admin_token,
        timeout=timeout,
        max_connections=max_connections,
        owns_pool=owns_pool,
    )
    return MetaClient(base_url, timeout=timeout, transport=transport, batches=batches)

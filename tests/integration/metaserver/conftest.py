"""Metaserver integration fixtures: real uvicorn servers over real sockets, memory or a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from pdgate.metaserver.app import create_app, running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings

from pdgate.meta_client import MetaClient
from tests.support.meta import store_url
from tests.support.redis import RedisServer
from tests.support.servers import UvicornThread


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


ServeMeta = Callable[..., UvicornThread]


@pytest.fixture
def fast_path() -> bool:
    """Whether served apps answer the hot ledger routes with `pdgate.metaserver.fastpath` (a test module may
    parametrize this to run against the plain FastAPI routes too)."""
    return True


@pytest.fixture
def serve_meta(store_kind: str, redis_server: RedisServer, fast_path: bool) -> Iterator[ServeMeta]:
    """Factory: start a metaserver app (settings overridable) on a free port, for this store kind."""
    started: list[UvicornThread] = []

    def serve(**overrides: Any) -> UvicornThread:
        fields: dict[str, Any] = {
            "store": store_url(store_kind, redis_server),
            "sweep_interval_s": 0.05,
            "fast_path": fast_path,
        }
        fields.update(overrides)
        server = UvicornThread(create_app(MetaSettings(**fields))).start()
        started.append(server)
        return server

    yield serve
    for server in started:
        server.stop()


@pytest.fixture
def meta_url(serve_meta: ServeMeta) -> str:
    return serve_meta().url


@pytest.fixture
async def http_client(meta_url: str) -> AsyncIterator[MetaClient]:
    async with MetaClient(meta_url) as client:
        yield client


@pytest.fixture(params=["http", "http-routes", "local"])
async def meta(
    request: pytest.FixtureRequest, store_kind: str, redis_server: RedisServer, serve_meta: ServeMeta
) -> AsyncIterator[Any]:
    """The MetaAPI: over HTTP (MetaClient -> real server, with and without the fast path) or in-process
    (LocalMetaClient)."""
    if request.param.startswith("http"):
        async with MetaClient(serve_meta(fast_path=request.param == "http").url) as client:
            yield client
    else:
        settings = MetaSettings(store=store_url(store_kind, redis_server), sweep_interval_s=0.05)
        async with running_service(settings) as service:
            yield LocalMetaClient(service)

"""Security fixtures: a real metaserver over real sockets, served the way `pdgate-metaserver` serves it.

`serve(...)` starts `create_app(MetaSettings(...))` under uvicorn with `pdgate.serving`'s guarded
protocol (header and body timeouts, early 413, connection cap), on the memory store or on a key prefix
of the session's real redis-server. `outside_ip` is this host's non-loopback address: a client that
connects to it is not a loopback peer, which is how protected mode is tested for real.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pdgate.metaserver.app import create_app, render_problem, server_limits
from pdgate.metaserver.settings import MetaSettings

from pdgate.serving import guarded_protocol
from tests.integration.router.test_router_bad_answers import engines  # noqa: F401 (the fixture, for this folder)
from tests.support.meta import store_url
from tests.support.redis import RedisServer
from tests.support.servers import UvicornThread

TOKEN = "t0ken-for-security-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Serve = Callable[..., UvicornThread]


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _outside_ip() -> str | None:
    """The address this host would use to reach another host (no packet is sent), if not loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = str(s.getsockname()[0])
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.fixture(scope="session")
def outside_ip() -> str:
    ip = _outside_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback address to connect from")
    return ip


def start_meta(settings: MetaSettings, *, host: str = "127.0.0.1") -> UvicornThread:
    protocol = guarded_protocol(server_limits(settings), render_problem)
    return UvicornThread(create_app(settings), host=host, http=protocol).start()


@pytest.fixture
def serve(store_kind: str, redis_server: RedisServer) -> Iterator[Serve]:
    """Factory: a served metaserver on this test's store kind; settings overridable, `host` too."""
    started: list[UvicornThread] = []

    def _serve(*, host: str = "127.0.0.1", **overrides: Any) -> UvicornThread:
        fields: dict[str, Any] = {"store": store_url(store_kind, redis_server), "sweep_interval_s": 0.05}
        fields.update(overrides)
        server = start_meta(MetaSettings(**fields), host=host)
        started.append(server)
        return server

    yield _serve
    for server in started:
        server.stop()


def registration(iid: str = "p0", url: str = "http://10.0.0.5:8100", **extra: Any) -> dict[str, Any]:
    return {"id": iid, "role": "prefill", "url": url, "model": "m", **extra}

"""Nothing reaches an engine until the body is complete (issue #21, finding 4).

Before, a pass-through request (/tokenize and the like) whose body never arrived still went to the engine
as `POST /tokenize` with a 0-byte body: the client had hung up, or had been answered 408 for a stalled
body, and the engine answered a request nobody sent. The engine here is a pdgate-sim process behind a
relay that records every request it carries; a well-formed request sent afterwards marks the point by
which the cut one would have arrived.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.router.conftest import Deployment
from tests.security.engine_log import EngineLog
from tests.support.ports import wait_until

STALL_S = 0.5
_HEAD = b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n"
_PART = b'{"model": "sim-model", "prompt": "'


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Deployment, EngineLog]]:
    with (
        EngineLog("both") as engine,
        Deployment(prefill=[engine.url], decode=[engine.url], body_timeout_s=STALL_S) as d,
    ):
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="the static engine")
        yield d, engine


def _marked(d: Deployment, engine: EngineLog) -> list[int]:
    """Send a whole /tokenize as a marker; the body sizes of the /tokenize requests the engine got, marker
    last (sent after the cut one, so the cut one had its chance to arrive first)."""
    before = len(engine.posts(b"/tokenize"))
    resp = httpx.post(d.url + "/tokenize", content=b'{"prompt": "marker"}', timeout=10)
    assert resp.status_code == 404  # pdgate-sim serves no /tokenize: it was asked, and said so
    wait_until(lambda: any(s.body == 20 for s in engine.posts(b"/tokenize")[before:]), timeout=10, what="the marker")
    return [s.body for s in engine.posts(b"/tokenize")]


def test_a_client_that_hangs_up_mid_body_sends_nothing_to_the_engine(served: tuple[Deployment, EngineLog]) -> None:
    d, engine = served
    engine.sent.clear()
    with socket.create_connection(("127.0.0.1", d.server.port)) as s:
        s.sendall(_HEAD + _PART)
    assert _marked(d, engine) == [20]


def test_a_stalled_body_gets_408_and_sends_nothing_to_the_engine(served: tuple[Deployment, EngineLog]) -> None:
    d, engine = served
    engine.sent.clear()
    with socket.create_connection(("127.0.0.1", d.server.port), timeout=10 * STALL_S) as s:
        s.sendall(_HEAD + _PART)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408")
    assert _marked(d, engine) == [20]

"""Header and URL size are bounded in bytes (issue #21, finding 1), on every server the project runs.

Before, a request head was bounded only in time: one connection with no credentials sending a 32 MB
header held the router's loop for seconds (the parser joins a header's bytes chunk by chunk, a cost that
grows with the square of its size), a parallel /health waited all that time, and the big request got
200. Now `pdgate.serving` counts the head's bytes as they arrive: past `max_header_bytes` the client gets
431, past `max_url_bytes` of URL 414, in the service's own error shape, at a cost linear in what was read.
The router (fast lane on, as shipped) and the metaserver run as their commands run them, in their own
process, so the /health timing measures the server and not this test's interpreter.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from pdgate.serving import ServerLimits
from tests.security.router_support import raw_exchange
from tests.support.ports import free_port
from tests.support.servers import wait_http

BIG = 32 << 20
HEALTH_BOUND_S = 0.050  # the bound for a parallel /health
_CHUNK = 1 << 20


@dataclass
class Served:
    name: str
    port: int
    error_code: Callable[[Any], str]  # reads the machine code out of the service's error body

    def code(self, body: bytes) -> str:
        return self.error_code(orjson.loads(body))


def _openai_code(doc: Any) -> str:
    return str(doc["error"]["code"])


def _problem_code(doc: Any) -> str:
    return str(doc["code"])


_COMMANDS = {
    "router": (["pdgate.router"], "PDGATE_ROUTER_", _openai_code),
    "metaserver": (["pdgate.metaserver"], "PDGATE_METASERVER_", _problem_code),
}


@pytest.fixture(scope="module", params=sorted(_COMMANDS))
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    module, prefix, code = _COMMANDS[request.param]
    port = free_port()
    env = {**os.environ, f"{prefix}PORT": str(port), f"{prefix}LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", *module], env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", status=None, timeout=30)
        yield Served(request.param, port, code)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _health_on(sock: socket.socket) -> float:
    """Seconds for one GET /health on an open keep-alive connection (any status: it must just answer)."""
    start = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the /health connection"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(
        next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return time.monotonic() - start


class _BigHeader(threading.Thread):
    """Sends a request whose one header is `BIG` bytes, then reads the answer's status."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.sent = 0
        self.status: int | None = None
        self.body = b""

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
                chunk = b"a" * _CHUNK
                while self.sent < BIG:
                    s.sendall(chunk)
                    self.sent += len(chunk)
                s.sendall(b"\r\n\r\n")
            except OSError:
                pass  # answered and closed before the whole header went out: fine, the answer is read below
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        head, _, self.body = got.partition(b"\r\n\r\n")
        self.status = int(head.split()[1]) if head else None


def test_a_32_mb_header_gets_431_and_does_not_stall_a_parallel_health(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as probe:
        _health_on(probe)  # connected and warm before the big one starts
        big = _BigHeader(served.port)
        big.start()
        while big.sent < 4 * _CHUNK and big.is_alive():
            time.sleep(0.001)
        took = [_health_on(probe) for _ in range(3)]
        big.join(timeout=60)
    assert not big.is_alive()
    assert min(took) < HEALTH_BOUND_S, took
    assert big.status == 431, big.body[:200]
    assert served.code(big.body) == "headers_too_large"


def test_a_100_kb_url_gets_414(served: Served) -> None:
    path = b"/health?" + b"q" * 100_000
    status, _, body = raw_exchange("127.0.0.1", served.port, b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 414
    assert served.code(body) == "url_too_long"


def test_a_head_within_the_limits_is_served(served: Served) -> None:
    """The bounds are not a cut for ordinary requests: a 16 KB header and a 4 KB URL are answered."""
    limits = ServerLimits()
    assert limits.max_header_bytes >= 32 * 1024 and limits.max_url_bytes >= 4 * 1024
    head = b"GET /health?" + b"q" * 4000 + b" HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 16_000 + b"\r\n\r\n"
    status, _, _ = raw_exchange("127.0.0.1", served.port, head)
    assert status in (200, 503)  # /health answers; 503 only says an engine or the store is missing

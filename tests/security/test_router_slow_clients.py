"""Slow and greedy clients on the router's port (issue 9): cut off, refused early, counted.

Before, a connection with no bytes, trickled headers or a declared body never sent stayed open past
150 s, and an over-long Content-Length was read before it was refused. The router runs here as an
operator runs it: the `pdgate-router` process (`python -m pdgate.router`), configured through its
environment, on a real socket.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest

from tests.security.router_support import raw_exchange
from tests.support.ports import free_port
from tests.support.servers import wait_http

LIMIT_S = 1.0
_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@dataclass
class Router:
    host: str
    port: int


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    port = free_port()
    env = {
        **os.environ,
        "PDGATE_ROUTER_PORT": str(port),
        "PDGATE_ROUTER_HEADER_TIMEOUT_S": str(LIMIT_S),
        "PDGATE_ROUTER_BODY_TIMEOUT_S": str(LIMIT_S),
        "PDGATE_ROUTER_MAX_BODY_BYTES": str(64 * 1024),
        "PDGATE_ROUTER_MAX_CONNECTIONS": "8",
        "PDGATE_ROUTER_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen([sys.executable, "-m", "pdgate.router"], env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", status=None, timeout=30)
        yield Router("127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, what it sent before)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    got = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - start, got
        got += chunk


def test_a_connection_that_sends_nothing_is_closed_with_408(router: Router) -> None:
    with socket.create_connection((router.host, router.port)) as s:
        took, got = _closed_within(s, 10 * LIMIT_S)
    assert took < 5 * LIMIT_S
    assert got.startswith(b"HTTP/1.1 408")
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_trickled_headers_are_cut_off(router: Router) -> None:
    with socket.create_connection((router.host, router.port)) as s:
        start = time.monotonic()
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
                s.sendall(bytes([byte]))
                time.sleep(0.05)
                if time.monotonic() - start > 10 * LIMIT_S:
                    pytest.fail("the router kept reading trickled headers")
        except OSError:
            pass  # closed under us: that is the point
        _, got = _closed_within(s, 10 * LIMIT_S)
    assert time.monotonic() - start < 5 * LIMIT_S
    assert got.startswith(b"HTTP/1.1 408") or got == b""


def test_a_declared_body_that_never_comes_is_cut_off(router: Router) -> None:
    with socket.create_connection((router.host, router.port)) as s:
        s.sendall(_HEAD + b"content-length: 500\r\n\r\n{")
        took, _ = _closed_within(s, 10 * LIMIT_S)
    assert took < 5 * LIMIT_S


def test_an_over_long_content_length_gets_413_before_the_body_is_sent(router: Router) -> None:
    head = _HEAD + b"content-length: 99999999\r\n\r\n"
    start = time.monotonic()
    status, headers, body = raw_exchange(router.host, router.port, head)
    assert time.monotonic() - start < LIMIT_S  # answered at once, not after waiting for the body
    assert status == 413 and headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["code"] == "body_too_large"


def test_connections_past_the_limit_get_503_with_retry_after(router: Router) -> None:
    held = [socket.create_connection((router.host, router.port)) for _ in range(8)]
    try:
        time.sleep(0.2)
        status, headers, body = raw_exchange(router.host, router.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status == 503 and headers["retry-after"] == "1"
        assert orjson.loads(body)["error"]["code"] == "server_busy"
    finally:
        for s in held:
            s.close()

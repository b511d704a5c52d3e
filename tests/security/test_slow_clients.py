"""Point: slow and greedy clients, on raw sockets against the served metaserver (`pdgate.serving`).

Plain uvicorn keeps a connection that sends no bytes, trickles its headers, or declares a body it never
sends open indefinitely, and counts no connections.
Here the limits are short (1 s) so each case is seen closing well within a test's patience.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from pdgate.metaserver.settings import MetaSettings

from tests.security.conftest import start_meta
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

LIMIT_S = 1.0


@pytest.fixture
def server() -> Iterator[UvicornThread]:
    settings = MetaSettings(header_timeout_s=LIMIT_S, body_timeout_s=LIMIT_S, max_body_bytes=4096, max_connections=8)
    srv = start_meta(settings)
    try:
        yield srv
    finally:
        srv.stop()


def _connect(srv: UvicornThread) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (monotonic) it closed."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic()


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (the server's answers here all have one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_silent_connection_is_closed(server: UvicornThread) -> None:
    with _connect(server) as sock:
        start = time.monotonic()
        data, closed = _read_until_closed(sock)
    assert closed - start < LIMIT_S + 2.5, closed - start
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data


def test_trickled_headers_are_cut_off(server: UvicornThread) -> None:
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for _ in range(40):  # one header byte every 0.1 s: never complete within the limit
                sock.sendall(b"X")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, closed = _read_until_closed(sock)
    assert closed - start < LIMIT_S + 2.5, closed - start
    assert b" 408 " in data.split(b"\r\n", 1)[0]


def test_declared_body_never_sent_is_cut_off(server: UvicornThread) -> None:
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        data, closed = _read_until_closed(sock)
    assert closed - start < LIMIT_S + 2.5, closed - start
    assert not data.startswith(b"HTTP/1.1 2")  # nothing was created from half a body


def test_a_slow_but_steady_body_is_served(server: UvicornThread) -> None:
    """The body timer measures stalls, not the whole upload: chunks every 0.3 s for 3 s in all pass."""
    body = b'{"prefill_instance_id": "p0", "request_id": "' + b"r" * 60 + b'"}'
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        for i in range(0, len(body), 8):
            sock.sendall(body[i : i + 8])
            time.sleep(0.3)
        answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]


def test_large_content_length_is_413_before_the_body(server: UvicornThread) -> None:
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"PUT /v1/handoffs/t1/ready HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n")
        data, closed = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]
    assert b"application/problem+json" in data and b"body_too_large" in data
    assert closed - start < 2.5  # answered at once, not after reading (or waiting for) 10 GB


def _open(srv: UvicornThread) -> int:
    """The connections the server counts against `max_connections` (uvicorn's own set)."""
    return len(srv.server.server_state.connections)


def test_connections_are_counted(server: UvicornThread) -> None:
    held = [_connect(server) for _ in range(8)]
    try:
        wait_until(lambda: _open(server) == 8, what="the server holding all 8 connections")
        with _connect(server) as extra:
            data, _ = _read_until_closed(extra)
        assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in data.lower(), data[:300]
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _open(server) == 0, what="the server seeing every connection closed")
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ")


def test_a_healthy_keep_alive_client_is_not_cut_off(server: UvicornThread) -> None:
    """The header timer covers one request at a time: a client that sends requests promptly on one
    connection, for longer than the limit in all, is served every time."""
    with _connect(server) as sock:
        start = time.monotonic()
        for _ in range(6):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]
            time.sleep(0.3)
        assert time.monotonic() - start > LIMIT_S

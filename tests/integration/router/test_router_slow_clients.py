"""A slow client gets a typed answer it can read, never a reset (issue 10, the 4,096-stream scale run).

Found by bench/chaos_scale.py: on a busy 2-core machine the load generator connected, then did not run
for longer than the router's header timeout. The router answered 408, but closed the socket a second
later; when the client woke and sent its request, the closed socket answered with a reset, and the
client saw an untyped connection error. A body that stalled was closed with no answer at all.

Here the served router (`pdgate.serving` under uvicorn, over a real socket) gets both: the late request
from the official `openai` client whose process stalls right after connecting (its httpcore network
backend blocks the whole client, as a starved process does), waking after the old one-second linger but
within one more header timeout; the stalled body on a raw socket. Each must get `request_timeout`.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from httpcore import AsyncNetworkStream
from httpcore._backends.auto import AutoBackend
from pdgate.router.app import create_app, serving_protocol
from pdgate.router.settings import RouterSettings

from tests.support.servers import UvicornThread

LIMIT_S = 1.5
ASLEEP_S = LIMIT_S + 1.2  # past the timeout and past the old linger of one second, within one more timeout


@pytest.fixture
def router() -> Iterator[UvicornThread]:
    settings = RouterSettings(
        host="127.0.0.1", header_timeout_s=LIMIT_S, body_timeout_s=LIMIT_S, log_level="warning", port=0
    )
    srv = UvicornThread(create_app(settings), http=serving_protocol(settings)).start()
    try:
        yield srv
    finally:
        srv.stop()


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes; a reset fails the test (that is the bug)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _error_code(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]["code"]


class _StarvedAfterConnect(AutoBackend):
    """httpcore's own backend, except that the whole client process stops right after connecting."""

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> AsyncNetworkStream:
        stream = await super().connect_tcp(*args, **kwargs)
        time.sleep(ASLEEP_S)  # noqa: ASYNC251 (on purpose: nothing of the client runs, like SIGSTOP)
        return stream


async def test_a_client_that_sends_its_request_late_reads_the_408(router: UvicornThread) -> None:
    transport = httpx.AsyncHTTPTransport()
    transport._pool._network_backend = _StarvedAfterConnect()  # private: httpx has no public hook for it
    async with httpx.AsyncClient(transport=transport) as http:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, http_client=http)
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model="m", prompt="hi", max_tokens=1, stream=True)
    assert err.value.status_code == 408
    assert isinstance(err.value.body, dict) and err.value.body.get("code") == "request_timeout", err.value.body


def test_a_stalled_body_gets_a_typed_408_not_a_bare_close(router: UvicornThread) -> None:
    with socket.create_connection((router.host, router.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        time.sleep(ASLEEP_S)
        sock.sendall(b'"m", "prompt": "the rest, late"')  # accepted and dropped, not reset
        answer = _read_all(sock)
    assert _error_code(answer) == (408, "request_timeout"), answer[:300]
    assert b"stalled" in answer

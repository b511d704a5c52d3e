"""What the proxy needs from an HTTP client to engines: the `Upstream` protocol and its exception tree.

`HttpPool` (`pdgate.http_pool`) implements it over sockets and is what the router runs on;
`HttpxUpstream` here implements it over an `httpx.AsyncClient`, so unit tests can script engines with
`httpx.MockTransport`. The proxy maps these exceptions to router errors through one table
(`pdgate.router.errors.UPSTREAM_FAILURES`).

Exception tree:
    UpstreamError
    ├── ConnectFailed      nothing was sent (refused, unreachable, connect timeout, unusable URL)
    ├── ConnectionClosed   closed or reset before the answer was complete
    ├── ReadTimeout        no byte within the timeout
    └── ProtocolFailure    the peer did not speak HTTP/1.1, or its body was over the limit
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import httpx

__all__ = [
    "ConnectFailed",
    "ConnectionClosed",
    "Headers",
    "HttpxUpstream",
    "ProtocolFailure",
    "ReadTimeout",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
]

Headers = Sequence[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """A request that got no complete answer."""


class ConnectFailed(UpstreamError):
    """Could not connect; the request was not sent."""


class ConnectionClosed(UpstreamError):
    """The connection ended before the answer was complete."""


class ReadTimeout(UpstreamError):
    """The peer sent nothing within the timeout."""


class ProtocolFailure(UpstreamError):
    """The peer's bytes were not a valid HTTP/1.1 response."""


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]  # names lower-case

    def header(self, name: bytes) -> bytes | None: ...
    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        """The next body bytes (whatever arrived, joined), None at the end of the body."""
        ...

    async def read(self, timeout: float | None = None, limit: int | None = None) -> bytes: ...
    def close(self) -> None:
        """Release: back to the pool when the body was read to its end, else abort the connection."""
        ...


class Upstream(Protocol):
    async def request(
        self, method: str, url: str, headers: Headers, body: bytes, *, timeout: float | None = None
    ) -> UpstreamResponse:
        """Send a request and wait (up to `timeout`) for the status line and headers."""
        ...

    async def aclose(self) -> None: ...


def find_header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


class _HttpxResponse:
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = [(k.lower(), v) for k, v in resp.headers.raw]
        self._iter = resp.aiter_bytes()  # aiter_raw refuses responses built from bytes (mocks)
        self._closed = False

    def header(self, name: bytes) -> bytes | None:
        return find_header(self.headers, name)

    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        if self._closed:
            return None
        try:
            while True:
                chunk = await asyncio.wait_for(self._iter.__anext__(), timeout)
                if chunk:
                    return chunk
        except StopAsyncIteration:
            self.close()
            return None
        except asyncio.TimeoutError as exc:
            self.close()
            raise ReadTimeout(f"no answer within {timeout:g} s") from exc
        except httpx.TransportError as exc:
            self.close()
            raise ConnectionClosed(f"upstream body failed: {exc!r}") from exc

    async def read(self, timeout: float | None = None, limit: int | None = None) -> bytes:
        parts = []
        while (chunk := await self.next_chunk(timeout)) is not None:
            parts.append(chunk)
        data = b"".join(parts)
        if limit is not None and len(data) > limit:
            raise ProtocolFailure(f"response body larger than {limit} bytes")
        return data

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            asyncio.get_running_loop().create_task(self._resp.aclose())


class HttpxUpstream:
    """`Upstream` over an `httpx.AsyncClient`: the seam for unit tests (`httpx.MockTransport`)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes, *, timeout: float | None = None
    ) -> _HttpxResponse:
        req = self._client.build_request(method, url, headers=list(headers), content=body, timeout=timeout)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.ConnectError as exc:
            raise ConnectFailed(str(exc)) from exc
        except httpx.TimeoutException as exc:
            raise ReadTimeout(str(exc)) from exc
        except httpx.TransportError as exc:
            raise ConnectionClosed(str(exc)) from exc
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._client.aclose()

"""`HttpPool`: the router's keep-alive HTTP/1.1 client to engines and the metaserver (an `Upstream`).

Why not httpx or aiohttp: `bench/router.py --libs` measures the client CPU per POST of each; the
router makes two or three upstream calls per request, and only a small client on httptools (the
parser uvicorn already uses) fits its budget. Results are in `bench/results/`.

What it does and no more: one connection per in-flight request, idle connections reused per origin
(LIFO, dropped after `keepalive_s` so an engine's keep-alive timeout never races us), bodies read in
chunks with back-pressure (`pdgate.http1`), and cancellation or `close()` before the end
*aborts* the connection, which is how an engine learns to abort the request. A request written to a
reused connection that the engine closed while idle is sent once more on a fresh one.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from urllib.parse import urlsplit

from pdgate.http1 import Http1Connection
from pdgate.upstream import ConnectFailed, ConnectionClosed, Headers, ProtocolFailure, find_header

__all__ = ["HttpPool", "Origin", "PoolResponse", "request_bytes"]

OriginKey = tuple[str, str, int]


class Origin:
    """Scheme, host and port of a URL, with the Host header value written for it."""

    __slots__ = ("host", "host_header", "key", "port", "scheme")

    def __init__(self, scheme: str, host: str, port: int) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.key: OriginKey = (scheme, host, port)
        default = 443 if scheme == "https" else 80
        shown = f"[{host}]" if ":" in host else host
        self.host_header = (shown if port == default else f"{shown}:{port}").encode()


def parse_url(url: str) -> tuple[Origin, bytes]:
    """(origin, request target) of an http(s) URL; ValueError when the URL cannot be requested."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # .port raises ValueError out of range
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Origin(parts.scheme, parts.hostname, port), path.encode()


def request_bytes(method: str, origin: Origin, target: bytes, headers: Headers, body: bytes) -> bytes:
    """The whole request as written to the socket: one `write`, one syscall."""
    head = [
        method.encode(),
        b" ",
        target,
        b" HTTP/1.1\r\nhost: ",
        origin.host_header,
        b"\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\n",
    ]
    for name, value in headers:
        head += (name, b": ", value, b"\r\n")
    head.append(b"\r\n")
    head.append(body)
    return b"".join(head)


class PoolResponse:
    """One answer being read from a pooled connection (an `UpstreamResponse`)."""

    __slots__ = ("_conn", "_done", "_pool", "_released", "headers", "key", "status")

    def __init__(self, pool: HttpPool, key: OriginKey, conn: Http1Connection) -> None:
        self._pool = pool
        self.key = key
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        return find_header(self.headers, name)

    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        conn = self._conn
        while True:
            if self._released:  # the connection may already serve another request: never read it
                if self._done:
                    return None
                raise ConnectionClosed("response already closed")
            data = conn.take()
            if data is not None:
                return data
            if conn.complete:
                self._done = True
                self.close()
                return None
            try:
                await conn.wait(timeout)
            except BaseException:
                self.close()
                raise

    async def read(self, timeout: float | None = None, limit: int | None = None) -> bytes:
        parts: list[bytes] = []
        size = 0
        while (chunk := await self.next_chunk(timeout)) is not None:
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                self.close()
                raise ProtocolFailure(f"response body larger than {limit} bytes")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.drained:
            self._pool.release(self.key, conn)
        else:
            conn.abort()


class HttpPool:
    """Keep-alive HTTP/1.1 connections per origin. One instance per event loop."""

    def __init__(
        self,
        *,
        connect_timeout: float = 3.0,
        keepalive_s: float = 4.0,
        max_idle_per_origin: int = 1024,
        ssl_context: _ssl.SSLContext | None = None,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle_per_origin
        self._ssl = ssl_context
        self._idle: dict[OriginKey, list[Http1Connection]] = {}
        self._urls: dict[str, tuple[Origin, bytes]] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _parse(self, url: str) -> tuple[Origin, bytes]:
        hit = self._urls.get(url)
        if hit is not None:
            return hit
        try:
            parsed = parse_url(url)
        except ValueError as exc:
            raise ConnectFailed(f"cannot request {url!r}: {exc}") from exc
        if len(self._urls) > 4096:
            self._urls.clear()
        self._urls[url] = parsed
        return parsed

    def _acquire(self, key: OriginKey, now: float) -> Http1Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closing and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.abort()
        return None

    def release(self, key: OriginKey, conn: Http1Connection) -> None:
        """Take back a connection whose answer was read to its end."""
        if self._closed:
            conn.abort()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    async def _connect(self, origin: Origin) -> Http1Connection:
        loop = self._loop or asyncio.get_running_loop()
        where = f"{origin.host}:{origin.port}"
        try:
            ssl = (self._ssl or _ssl.create_default_context()) if origin.scheme == "https" else None
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Http1Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=ssl,
                    server_hostname=origin.host if ssl else None,
                ),
                self._connect_timeout,
            )
        except asyncio.TimeoutError as exc:
            raise ConnectFailed(f"connect to {where} timed out") from exc
        except Exception as exc:  # OSError, and ValueError/OverflowError/UnicodeError for unusable addresses
            raise ConnectFailed(f"connect to {where} failed: {type(exc).__name__}: {exc}") from exc
        return conn

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes, *, timeout: float | None = None
    ) -> PoolResponse:
        if self._closed:
            raise ConnectFailed("the HTTP pool is closed")
        origin, target = self._parse(url)
        payload = request_bytes(method, origin, target, headers, body)
        loop = self._loop
        if loop is None:  # one pool per event loop; asking for it per request costs a getpid syscall
            loop = self._loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            conn = self._acquire(origin.key, loop.time())
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            conn.begin()
            assert conn.transport is not None
            try:
                if conn.closing:  # closed by the peer (a refusal, an idle timeout) before the request went out
                    raise ConnectionClosed("connection closed before the request was sent")
                conn.transport.write(payload)
                while not conn.head_done:
                    await conn.wait(timeout)
            except ConnectionClosed:
                conn.abort()
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # the engine closed an idle keep-alive connection: resend on a fresh one
                raise
            except BaseException:
                conn.abort()
                raise
            return PoolResponse(self, origin.key, conn)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()

"""How `MetaClient` reaches the metaserver: a `MetaTransport` sends one request and answers its status and
body. The routes, bodies, answer parsing, typed errors and batching stay in `pdgate.meta_client`; a
transport only moves bytes.

Why a seam and not subclasses: the client had two HTTP layers (httpx, and the router's `HttpPool`) as a
subclass that replaced `_call`, and the connector subclassed that again to close its pool; the
ledger-move batching rode on the same subclass. Each layer is now a small object behind one method, and
the client composes it with the batching, so a new layer (or a fake in a test) implements `send` only.

    HttpxTransport  httpx.AsyncClient: the default; any `httpx.AsyncBaseTransport` may sit under it
    PoolTransport   the router's keep-alive `HttpPool` (httptools): fewer allocations and GIL hand-overs
                    per call, with a cap on connections (see its docstring)

A transport raises `MetaUnavailable` (or another `MetaError`) when no answer came; any answer that came,
whatever its status, is returned for the client to read.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import httpx

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaUnavailable, transport_error
from pdgate.upstream import ReadTimeout

__all__ = ["HttpxTransport", "MetaTransport", "PoolTransport"]

_JSON = (b"content-type", b"application/json")


class MetaTransport(Protocol):
    """One request to the metaserver. `path` starts with "/" and carries its query string; `body` is JSON
    (None: no body); `timeout` covers the whole call. Returns (status, body bytes)."""

    @property
    def base_url(self) -> str: ...

    async def send(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class HttpxTransport:
    """Over `httpx.AsyncClient` (`transport`: an httpx transport under it, e.g. `httpx.MockTransport`)."""

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        timeout: float = 5.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    async def send(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            resp = await self._http.request(method, path, content=body, headers=headers, timeout=timeout)
        except httpx.TransportError as exc:
            raise transport_error(exc, method, path) from exc
        return resp.status_code, resp.content

    async def aclose(self) -> None:
        await self._http.aclose()


class PoolTransport:
    """Over the router's `HttpPool`.

    Why: the router creates one handoff per request, so the metaserver call is on the hot path, and
    httpx's request/response/URL/cookie models cost more router CPU than the socket work itself (profile
    `bench/router.py` with py-spy to see it); in the connector's control thread each event-loop turn is a
    GIL hand-over, and this client takes fewer (`bench/control.py`).

    Why a cap on connections (`max_connections`): each ledger call holds one connection until its answer
    is read, so without one the router opened a connection per in-flight request; at 4,096 streams that
    passed the metaserver's own connection cap, which refuses the rest (bench/router.py found it). Calls
    past the cap wait for a free connection, within the client's timeout, and a call that cannot get one
    in time is `MetaUnavailable` like any unreachable metaserver.

    `owns_pool`: close the pool with the transport (the connector's; the router closes its own).
    """

    def __init__(
        self,
        base_url: str,
        pool: HttpPool,
        *,
        admin_token: str | None = None,
        timeout: float = 5.0,
        max_connections: int = 256,
        owns_pool: bool = False,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._pool = pool
        self._owns_pool = owns_pool
        self._timeout = timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._max_connections = max_connections
        self._auth = [(b"authorization", f"Bearer {admin_token}".encode())] if admin_token else []
        self._json_auth = [_JSON, *self._auth]

    @property
    def base_url(self) -> str:
        return self._base

    async def send(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        slots = self._slots
        if slots.locked():  # every connection busy: wait for one, within the client's timeout
            try:
                await asyncio.wait_for(slots.acquire(), self._timeout)
            except asyncio.TimeoutError:
                raise MetaUnavailable(
                    f"metaserver {method} {path}: all {self._max_connections} connections stayed busy for "
                    f"{self._timeout:g}s"
                ) from None
        else:
            await slots.acquire()  # free: returns at once, without yielding to the loop
        try:
            headers = self._json_auth if body is not None else self._auth
            resp = await self._pool.request(method, self._base + path, headers, body or b"", timeout=timeout)
            data = await resp.read(timeout=timeout)
        except ReadTimeout as exc:
            raise MetaUnavailable(f"metaserver {method} {path} timed out: {exc}") from exc
        except Exception as exc:  # any failure to reach it, typed or not, means "unavailable"
            raise MetaUnavailable(f"metaserver {method} {path} unreachable: {exc!r}") from exc
        finally:
            slots.release()
        return resp.status, data

    async def aclose(self) -> None:
        if self._owns_pool:
            await self._pool.aclose()

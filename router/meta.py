"""`PooledMetaClient`: `MetaClient` with its HTTP layer replaced by the router's `HttpPool`.

Why: the router creates one handoff per request, so the metaserver call is on the hot path, and
httpx's request/response/URL/cookie models cost more router CPU than the socket work itself (profile
`bench/router.py` with py-spy to see it). Everything else (routes, bodies, answers parsed into the
contract models, the typed `MetaError`s) is `MetaClient`'s own code: only `_call` is replaced.

Why a cap on connections (`max_connections`): each ledger call holds one connection until its answer
is read, so without one the router opened a connection per in-flight request; at 4,096 streams that
passed the metaserver's own connection cap, which refuses the rest (bench/router.py found it). Calls
past the cap wait for a free connection, within the call's timeout, and a call that cannot get one in
time is `MetaUnavailable` like any unreachable metaserver.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlencode

import orjson
from pdgate.metaserver.client import MetaClient, MetaUnavailable, error_from_answer
from pdgate.router.http_pool import HttpPool
from pdgate.router.upstream import ReadTimeout
from pydantic import BaseModel

__all__ = ["PooledMetaClient"]

_JSON = (b"content-type", b"application/json")


class PooledMetaClient(MetaClient):
    def __init__(
        self,
        base_url: str,
        *,
        pool: HttpPool,
        admin_token: str | None = None,
        timeout: float = 5.0,
        max_connections: int = 256,
    ) -> None:
        super().__init__(base_url, admin_token=admin_token, timeout=timeout)
        self._pool = pool
        self._slots = asyncio.Semaphore(max_connections)
        self._max_connections = max_connections
        self._base = base_url.rstrip("/")
        self._auth = [(b"authorization", f"Bearer {admin_token}".encode())] if admin_token else []

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        wait: float | None = None,
    ) -> Any:
        url = self._base + path + ("?" + urlencode(params) if params else "")
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else b""
        headers = [_JSON, *self._auth] if body is not None else self._auth
        timeout = self._timeout + wait if wait else self._timeout
        slots = self._slots
        if slots.locked():  # every connection busy: wait for one, within this call's timeout
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
            resp = await self._pool.request(method, url, headers, content, timeout=timeout)
            data = await resp.read(timeout=timeout)
        except ReadTimeout as exc:
            raise MetaUnavailable(f"metaserver {method} {path} timed out: {exc}") from exc
        except Exception as exc:  # any failure to reach it, typed or not, means "unavailable"
            raise MetaUnavailable(f"metaserver {method} {path} unreachable: {exc!r}") from exc
        finally:
            slots.release()
        if resp.status >= 400:
            raise error_from_answer(resp.status, data, method, path)
        if resp.status == 204 or not data:
            return None
        return orjson.loads(data)

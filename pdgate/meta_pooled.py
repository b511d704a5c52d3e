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

Why batches (`batches`, --metaserver-batches): per client request the router makes two ledger calls (the
create before the prefill, the claim before the decode), so as single calls the metaserver cost the
router two of its four upstream round trips per request. A lone call goes as its single route; a call
made while another is out goes through `pdgate.batcher`, so the calls of requests in flight
ride together (`POST /v1/handoffs/batch`, at most `batches` such requests out at once). Each caller
still gets its own record or the typed `MetaError` its single call would raise, so the router's rules
(a fresh transfer id on `handoff_exists`, the claim's long poll while PENDING) are unchanged. A
metaserver without the batch route (an older one: 404) gets the batch's items as single calls, and
every call after that goes single. Measured:
docs/COMPARISON.md ("Ledger calls in batches"). READY and DONE go the same way for `pdgate-sim`, which
uses this client as an engine: the connector's control thread batches them too (`connector/control.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any
from urllib.parse import urlencode

import orjson
from pydantic import BaseModel

from pdgate.batcher import Batcher
from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient, MetaUnavailable, error_from_answer
from pdgate.models import (
    BatchAbort,
    BatchClaim,
    BatchCreate,
    BatchDone,
    BatchItem,
    BatchReady,
    Handoff,
    HandoffCreate,
    KVLocation,
)
from pdgate.upstream import ReadTimeout

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
        batches: int = 0,
    ) -> None:
        super().__init__(base_url, admin_token=admin_token, timeout=timeout)
        self._pool = pool
        self._slots = asyncio.Semaphore(max_connections)
        self._max_connections = max_connections
        self._base = base_url.rstrip("/")
        self._auth = [(b"authorization", f"Bearer {admin_token}".encode())] if admin_token else []
        self._batcher = Batcher(self.batch, max_in_flight=batches) if batches > 0 else None
        self._out = 0  # ledger moves out now, single or batched

    # The ledger moves: alone, each goes as `MetaClient`'s single route; with another out, in a batch.
    async def create_handoff(self, body: HandoffCreate) -> Handoff:
        return await self._move(
            partial(MetaClient.create_handoff, self, body),
            lambda: BatchCreate.model_construct(body.model_fields_set, **body.__dict__),
        )

    async def mark_ready(self, transfer_id: str, location: KVLocation) -> Handoff:
        return await self._move(
            partial(MetaClient.mark_ready, self, transfer_id, location),
            lambda: BatchReady(transfer_id=transfer_id, location=location),
        )

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff:
        return await self._move(
            partial(MetaClient.claim, self, transfer_id, decode_instance_id, lease_s),
            lambda: BatchClaim(transfer_id=transfer_id, decode_instance_id=decode_instance_id, lease_s=lease_s),
        )

    async def done(self, transfer_id: str, decode_instance_id: str | None = None) -> Handoff:
        return await self._move(
            partial(MetaClient.done, self, transfer_id, decode_instance_id),
            lambda: BatchDone(transfer_id=transfer_id, decode_instance_id=decode_instance_id),
        )

    async def abort(self, transfer_id: str, reason: str) -> Handoff:
        return await self._move(
            partial(MetaClient.abort, self, transfer_id, reason),
            lambda: BatchAbort(transfer_id=transfer_id, reason=reason),
        )

    async def _move(self, single: Callable[[], Awaitable[Handoff]], item: Callable[[], BatchItem]) -> Handoff:
        """A ledger move made while no other is out goes as its single route: for a lone call, the batch's
        envelope and the batcher's extra loop turn and task cost more router CPU than they save (about
        +60 us per call at concurrency 1, measured); only calls that would wait behind another go batched."""
        batcher = self._batcher if self._out and self.batch_route else None
        self._out += 1
        try:
            return await (single() if batcher is None else batcher.call(item()))
        finally:
            self._out -= 1

    async def aclose(self) -> None:
        if self._batcher is not None:
            await self._batcher.aclose()
        await super().aclose()

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

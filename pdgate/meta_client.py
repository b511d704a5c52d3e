"""MetaClient: the one async client of the metaserver, used by the router and the connector.

No other module formats a metaserver URL. Every answer is parsed into the models of
`pdgate.models`; every failure is raised as a `MetaError`, a `pdgate.errors.PDGateError`
whose `code` (a `pdgate.errors.Code`) is the problem body's `code`, so a caller decides on types (retry
on `MetaUnavailable`, give up on `MetaGone`) or codes, never on strings.

Exception families, chosen by the answer's HTTP status (`BY_STATUS`, this boundary's one table):
    MetaError               any other status (code from the body, else internal_error)
    ├── MetaBadRequest      400/413/422: the body or a parameter was refused
    ├── MetaUnauthorized    401/403: missing or wrong admin token
    ├── MetaNotFound        404: unknown id (an instance whose lease lapsed is unknown)
    ├── MetaConflict        409: illegal transition / someone else won the claim (`current_state`)
    ├── MetaGone            410: the handoff is terminal (`current_state`)
    └── MetaUnavailable     502/503/504, connection errors and timeouts (`TRANSPORT_ERRORS`): retryable
The service's own errors (`pdgate.metaserver.errors`) subclass these families, so an in-process caller
(`LocalMetaClient`) catches the same types.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar
from urllib.parse import urlencode

import httpx
import orjson
from pydantic import BaseModel

from pdgate.errors import Code, PDGateError, info
from pdgate.models import (
    AbortBody,
    BatchAbort,
    BatchBody,
    BatchClaim,
    BatchCreate,
    BatchDone,
    BatchItem,
    BatchReady,
    ClaimBody,
    DoneBody,
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HandoffState,
    HeartbeatBody,
    HeartbeatResponse,
    Instance,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    RegisterResponse,
    Role,
)

if TYPE_CHECKING:
    from pdgate.batcher import Batcher
    from pdgate.meta_transport import MetaTransport

__all__ = [
    "MetaAPI",
    "MetaBadRequest",
    "MetaClient",
    "MetaConflict",
    "MetaError",
    "MetaGone",
    "MetaNotFound",
    "MetaUnauthorized",
    "MetaUnavailable",
    "error_from_answer",
    "error_from_problem",
]

M = TypeVar("M", bound=BaseModel)


class MetaError(PDGateError):
    """Base of every metaserver failure, raised alike over HTTP and in-process.

    `status` is the HTTP status the failure answers with (or answered with, when rebuilt from an
    answer); `current_state` is set on 409/410 about a handoff.
    """

    code: ClassVar[Code] = Code.INTERNAL

    def __init__(
        self,
        detail: str,
        *,
        code: Code | str | None = None,
        status: int | None = None,
        current_state: HandoffState | None = None,
    ) -> None:
        super().__init__(detail, code=_known(code))
        self._status = status
        self.current_state = current_state

    @property
    def detail(self) -> str:
        return self.message

    @property
    def status(self) -> int:
        return self._status if self._status is not None else info(self.code).status


def _known(code: Code | str | None) -> Code | None:
    """A code of the vocabulary, or None (the class's own) for one this version does not know."""
    if code is None or isinstance(code, Code):
        return code
    try:
        return Code(code)
    except ValueError:
        return None


class MetaBadRequest(MetaError):
    code = Code.INVALID_REQUEST


class MetaUnauthorized(MetaError):
    code = Code.UNAUTHORIZED


class MetaNotFound(MetaError):
    code = Code.NOT_FOUND


class MetaConflict(MetaError):
    code = Code.ILLEGAL_TRANSITION


class MetaGone(MetaError):
    code = Code.HANDOFF_TERMINAL


class MetaUnavailable(MetaError):
    code = Code.METASERVER_UNAVAILABLE


# An answer's HTTP status -> the family raised (any other status: MetaError).
BY_STATUS: dict[int, type[MetaError]] = {
    400: MetaBadRequest,
    401: MetaUnauthorized,
    403: MetaUnauthorized,
    404: MetaNotFound,
    409: MetaConflict,
    410: MetaGone,
    413: MetaBadRequest,
    422: MetaBadRequest,
    502: MetaUnavailable,
    503: MetaUnavailable,
    504: MetaUnavailable,
}

# The HTTP layer's failures -> (error raised, what happened), first match wins.
TRANSPORT_ERRORS: dict[type[Exception], tuple[type[MetaError], str]] = {
    httpx.TimeoutException: (MetaUnavailable, "timed out"),
    httpx.TransportError: (MetaUnavailable, "unreachable"),
}


class MetaAPI(Protocol):
    """What the router and the connector need from the metaserver.

    `MetaClient` implements it over HTTP; the router's embedded metaserver may implement it
    in-process with the same semantics and the same exceptions.
    """

    async def register(self, reg: InstanceRegistration) -> RegisterResponse: ...
    async def heartbeat(self, instance_id: str, load: InstanceLoad | None = None) -> HeartbeatResponse: ...
    async def drain(self, instance_id: str) -> Instance: ...
    async def deregister(self, instance_id: str) -> None: ...
    async def list_instances(
        self, *, role: Role | None = None, model: str | None = None, state: InstanceState | None = None
    ) -> list[Instance]: ...
    async def get_instance(self, instance_id: str) -> Instance: ...
    async def create_handoff(self, body: HandoffCreate) -> Handoff: ...
    async def mark_ready(self, transfer_id: str, location: KVLocation) -> Handoff: ...
    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff: ...
    async def done(self, transfer_id: str, decode_instance_id: str) -> Handoff: ...
    async def abort(self, transfer_id: str, reason: str) -> Handoff: ...
    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff: ...
    async def events(self, instance_id: str, cursor: str | None = None, wait: float | None = None) -> HandoffEvents: ...


class MetaClient:
    """Async client for every metaserver route, over a `pdgate.meta_transport.MetaTransport`.

    `transport`: a `MetaTransport` (e.g. `PoolTransport`), or an httpx transport to put under the default
    `HttpxTransport`, or None for that default. `admin_token` and `max_connections` configure the default
    only; a transport given whole carries its own.

    Long-polls (`get_handoff(wait=...)`, `events(wait=...)`) extend the timeout by the wait, so a long-poll
    is never cut by the client's own default timeout.

    Batches (`batches` > 0): a ledger move (create, READY, claim, DONE, abort) made while no other is out
    goes as its single route (for it the batch's envelope and extra loop turn cost more than they save:
    +60 us per call at concurrency 1); one made while another is out rides in a `pdgate.batcher.Batcher`
    (at most `batches` requests out). Each caller still gets the record or the typed `MetaError` its single
    call would raise. Measured: docs/COMPARISON.md ("Ledger calls in batches").
    """

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        timeout: float = 5.0,
        transport: MetaTransport | httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
        batches: int = 0,
    ) -> None:
        if transport is None or isinstance(transport, httpx.AsyncBaseTransport):
            from pdgate.meta_transport import HttpxTransport  # it imports this module's errors

            transport = HttpxTransport(
                base_url, admin_token=admin_token, timeout=timeout, max_connections=max_connections, transport=transport
            )
        self._transport: MetaTransport = transport
        self._timeout = timeout
        self.batch_route = True  # False once the metaserver answered the batch route 404/405 (an older one)
        self._batcher: Batcher | None = None
        if batches > 0:
            from pdgate.batcher import Batcher  # it imports this module's errors

            self._batcher = Batcher(self.batch, max_in_flight=batches)
        self._out = 0  # ledger moves out now, single or batched (counted only when batching)

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    @property
    def batcher(self) -> Batcher | None:
        """The ledger-move queue when batching (`batches` > 0), for stats."""
        return self._batcher

    async def aclose(self) -> None:
        if self._batcher is not None:
            await self._batcher.aclose()
        await self._transport.aclose()

    async def __aenter__(self) -> MetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one call ---------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        wait: float | None = None,
    ) -> Any:
        if params:
            path = f"{path}?{urlencode(params)}"
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        status, data = await self._transport.send(
            method, path, content, self._timeout + wait if wait else self._timeout
        )
        if status >= 400:
            raise error_from_answer(status, data, method, path)
        if status == 204 or not data:
            return None
        return orjson.loads(data)

    async def _model(self, cls: type[M], method: str, path: str, **kw: Any) -> M:
        try:
            return cls.model_validate(await self._call(method, path, **kw))
        except ValueError as exc:  # not JSON, or not the record (pydantic's ValidationError is a ValueError)
            raise _undecodable(method, path, exc) from exc

    # -- registry ---------------------------------------------------------------------------

    async def register(self, reg: InstanceRegistration) -> RegisterResponse:
        return await self._model(RegisterResponse, "POST", "/v1/instances", body=reg)

    async def heartbeat(self, instance_id: str, load: InstanceLoad | None = None) -> HeartbeatResponse:
        return await self._model(
            HeartbeatResponse, "POST", f"/v1/instances/{instance_id}/heartbeat", body=HeartbeatBody(load=load)
        )

    async def drain(self, instance_id: str) -> Instance:
        return await self._model(Instance, "POST", f"/v1/instances/{instance_id}/drain")

    async def deregister(self, instance_id: str) -> None:
        await self._call("DELETE", f"/v1/instances/{instance_id}")

    async def list_instances(
        self, *, role: Role | None = None, model: str | None = None, state: InstanceState | None = None
    ) -> list[Instance]:
        params = {
            k: v.value if hasattr(v, "value") else v
            for k, v in (("role", role), ("model", model), ("state", state))
            if v is not None
        }
        data = await self._call("GET", "/v1/instances", params=params)
        return [Instance.model_validate(x) for x in data["instances"]]

    async def get_instance(self, instance_id: str) -> Instance:
        return await self._model(Instance, "GET", f"/v1/instances/{instance_id}")

    # -- handoff ledger: the five moves, each alone as its single route or, with another out, batched --

    async def create_handoff(self, body: HandoffCreate) -> Handoff:
        if self._batcher is None:
            return await self._create(body)
        return await self._move(
            partial(self._create, body), lambda: BatchCreate.model_construct(body.model_fields_set, **body.__dict__)
        )

    async def mark_ready(self, transfer_id: str, location: KVLocation) -> Handoff:
        if self._batcher is None:
            return await self._ready(transfer_id, location)
        return await self._move(
            partial(self._ready, transfer_id, location),
            lambda: BatchReady(transfer_id=transfer_id, location=location),
        )

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff:
        if self._batcher is None:
            return await self._claim(transfer_id, decode_instance_id, lease_s)
        return await self._move(
            partial(self._claim, transfer_id, decode_instance_id, lease_s),
            lambda: BatchClaim(transfer_id=transfer_id, decode_instance_id=decode_instance_id, lease_s=lease_s),
        )

    async def done(self, transfer_id: str, decode_instance_id: str) -> Handoff:
        if self._batcher is None:
            return await self._done(transfer_id, decode_instance_id)
        return await self._move(
            partial(self._done, transfer_id, decode_instance_id),
            lambda: BatchDone(transfer_id=transfer_id, decode_instance_id=decode_instance_id),
        )

    async def abort(self, transfer_id: str, reason: str) -> Handoff:
        if self._batcher is None:
            return await self._abort(transfer_id, reason)
        return await self._move(
            partial(self._abort, transfer_id, reason), lambda: BatchAbort(transfer_id=transfer_id, reason=reason)
        )

    async def _move(self, single: Callable[[], Awaitable[Handoff]], item: Callable[[], BatchItem]) -> Handoff:
        """Alone -> `single` (the single route); with another move out -> the batcher (class docstring)."""
        batcher = self._batcher if self._out and self.batch_route else None
        self._out += 1
        try:
            return await (single() if batcher is None else batcher.call(item()))
        finally:
            self._out -= 1

    # The single routes. The batch's fallback (`_single`) calls these, never the public moves: those would
    # send the item straight back into a batch.

    async def _create(self, body: HandoffCreate) -> Handoff:
        return await self._model(Handoff, "POST", "/v1/handoffs", body=body)

    async def _ready(self, transfer_id: str, location: KVLocation) -> Handoff:
        return await self._model(Handoff, "PUT", f"/v1/handoffs/{transfer_id}/ready", body=location)

    async def _claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None) -> Handoff:
        body = ClaimBody(decode_instance_id=decode_instance_id, lease_s=lease_s)
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/claim", body=body)

    async def _done(self, transfer_id: str, decode_instance_id: str) -> Handoff:
        body = DoneBody(decode_instance_id=decode_instance_id)
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/done", body=body)

    async def _abort(self, transfer_id: str, reason: str) -> Handoff:
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/abort", body=AbortBody(reason=reason))

    async def batch(self, items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        """Many ledger calls in one request (`POST /v1/handoffs/batch`): per item, in order, the record or
        the typed error its single call would have raised. A failure of the request itself (unreachable,
        refused envelope) raises. A metaserver without the batch route (404/405) gets the calls one by one,
        concurrently, so a newer client works against an older server. A body the metaserver found too
        large (413) is never the items' fate: the batch is split in halves, each sent again, and an item
        refused alone goes as its single call (which answers that item's own outcome)."""
        if not items:
            return []
        body = BatchBody(items=list(items))
        try:
            data = await self._call("POST", "/v1/handoffs/batch", body=body)
        except MetaError as exc:
            if exc.status == 413:
                return await self._split(items)
            if exc.status not in (404, 405):
                raise
            self.batch_route = False
            return list(await asyncio.gather(*(self._single(item) for item in items)))
        except ValueError as exc:
            raise _undecodable("POST", "/v1/handoffs/batch", exc) from exc
        out: list[Handoff | MetaError] = []
        try:  # one result per item, in order, each a record or a problem: anything else fails every item
            for item, result in zip(items, data["results"], strict=True):
                if "handoff" in result and result["handoff"] is not None:
                    out.append(Handoff.model_validate(result["handoff"]))
                else:
                    status = result.get("status", 500)
                    out.append(error_from_problem(status, result.get("problem"), "POST", _path(item)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _undecodable("POST", "/v1/handoffs/batch", exc) from exc
        return out

    async def _split(self, items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        """A batch refused as too large (413), sent again as two halves (one item: its single call)."""
        if len(items) == 1:
            return [await self._single(items[0])]
        half = len(items) // 2
        first, second = await asyncio.gather(self.batch(items[:half]), self.batch(items[half:]))
        return first + second

    async def _single(self, item: BatchItem) -> Handoff | MetaError:
        try:
            if isinstance(item, BatchCreate):
                return await self._create(HandoffCreate.model_validate(item.model_dump(exclude={"op"})))
            if isinstance(item, BatchReady):
                return await self._ready(item.transfer_id, item.location)
            if isinstance(item, BatchClaim):
                return await self._claim(item.transfer_id, item.decode_instance_id, item.lease_s)
            if isinstance(item, BatchDone):
                return await self._done(item.transfer_id, item.decode_instance_id)
            return await self._abort(item.transfer_id, item.reason)
        except MetaError as exc:
            return exc

    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff:
        params = {"wait": wait} if wait else None
        return await self._model(Handoff, "GET", f"/v1/handoffs/{transfer_id}", params=params, wait=wait)

    async def events(self, instance_id: str, cursor: str | None = None, wait: float | None = None) -> HandoffEvents:
        params: dict[str, Any] = {}
        if cursor is not None:
            params["cursor"] = cursor
        if wait:
            params["wait"] = wait
        return await self._model(
            HandoffEvents, "GET", f"/v1/instances/{instance_id}/handoff-events", params=params, wait=wait
        )

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/health")
        return result


def _undecodable(method: str, path: str, exc: Exception) -> MetaUnavailable:
    """A 2xx answer it cannot read: a metaserver not speaking this contract is as good as none."""
    return MetaUnavailable(f"metaserver {method} {path} answered what this client cannot read: {exc!r:.200}")


def transport_error(exc: Exception, method: str, path: str) -> MetaError:
    """The `TRANSPORT_ERRORS` entry for `exc` (MetaUnavailable when none matches)."""
    for kind, (cls, what) in TRANSPORT_ERRORS.items():
        if isinstance(exc, kind):
            return cls(f"metaserver {method} {path} {what}: {exc!r}")
    return MetaUnavailable(f"metaserver {method} {path} failed: {exc!r}")


def _path(item: BatchItem) -> str:
    return "/v1/handoffs" if isinstance(item, BatchCreate) else f"/v1/handoffs/{item.transfer_id}/{item.op}"


def error_from_answer(status: int, content: bytes, method: str, path: str) -> MetaError:
    """Turn an RFC 7807 (or FastAPI `detail`) answer into the typed error for its status (`BY_STATUS`),
    carrying the body's `code` and `current_state`.

    Public so that code reading an answer outside `MetaClient` raises exactly the errors this client raises.
    """
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    return error_from_problem(status, data, method, path)


def error_from_problem(status: int, data: Any, method: str, path: str) -> MetaError:
    """`error_from_answer` for a problem already parsed (a batch item's, or any JSON value)."""
    cls = BY_STATUS.get(status, MetaError) if isinstance(status, int) else MetaError
    detail = f"metaserver {method} {path} answered {status}"
    code: str | None = None
    state: HandoffState | None = None
    if isinstance(data, dict):
        if isinstance(data.get("detail"), str):
            detail = f"{detail}: {data['detail']}"
        elif data.get("detail") is not None:
            detail = f"{detail}: {data['detail']!r}"
        code = data.get("code") if isinstance(data.get("code"), str) else None
        raw_state = data.get("current_state")
        if raw_state in HandoffState.__members__:
            state = HandoffState(raw_state)
    return cls(detail, status=status, code=code, current_state=state)

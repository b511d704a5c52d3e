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
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import httpx
import orjson
from pydantic import BaseModel

from pdgate.errors import Code, PDGateError, info
from pdgate.models import (
    AbortBody,
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
    async def done(self, transfer_id: str, decode_instance_id: str | None = None) -> Handoff: ...
    async def abort(self, transfer_id: str, reason: str) -> Handoff: ...
    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff: ...
    async def events(self, instance_id: str, cursor: str | None = None, wait: float | None = None) -> HandoffEvents: ...


class MetaClient:
    """Async HTTP client for every metaserver route.

    Long-polls (`get_handoff(wait=...)`, `events(wait=...)`) extend the read timeout by the wait, so
    a long-poll is never cut by the client's own default timeout.
    """

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self.batch_route = True  # False once the metaserver answered the batch route 404/405 (an older one)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> MetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport --------------------------------------------------------------------------

    async def _call(  # extension point: a subclass may send over another HTTP layer (pdgate/meta_pooled.py)
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        wait: float | None = None,
    ) -> Any:
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        timeout = self._timeout + wait if wait else self._timeout
        try:
            resp = await self._http.request(
                method, path, content=content, params=params, headers=headers, timeout=timeout
            )
        except httpx.TransportError as exc:
            raise transport_error(exc, method, path) from exc
        if resp.status_code >= 400:
            raise _error_from(resp, method, path)
        if resp.status_code == 204 or not resp.content:
            return None
        return orjson.loads(resp.content)

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

    # -- handoff ledger ---------------------------------------------------------------------

    async def create_handoff(self, body: HandoffCreate) -> Handoff:
        return await self._model(Handoff, "POST", "/v1/handoffs", body=body)

    async def mark_ready(self, transfer_id: str, location: KVLocation) -> Handoff:
        return await self._model(Handoff, "PUT", f"/v1/handoffs/{transfer_id}/ready", body=location)

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff:
        body = ClaimBody(decode_instance_id=decode_instance_id, lease_s=lease_s)
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/claim", body=body)

    async def done(self, transfer_id: str, decode_instance_id: str | None = None) -> Handoff:
        body = DoneBody(decode_instance_id=decode_instance_id)
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/done", body=body)

    async def abort(self, transfer_id: str, reason: str) -> Handoff:
        return await self._model(Handoff, "POST", f"/v1/handoffs/{transfer_id}/abort", body=AbortBody(reason=reason))

    async def batch(self, items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        """Many ledger calls in one request (`POST /v1/handoffs/batch`): per item, in order, the record or
        the typed error its single call would have raised. A failure of the request itself (unreachable,
        refused envelope) raises. A metaserver without the batch route (404/405) gets the calls one by one,
        concurrently, so a newer client works against an older server."""
        if not items:
            return []
        body = BatchBody(items=list(items))
        try:
            data = await self._call("POST", "/v1/handoffs/batch", body=body)
        except MetaError as exc:
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

    async def _single(self, item: BatchItem) -> Handoff | MetaError:
        # The single routes themselves (`MetaClient.x(self, ...)`), not a subclass's override: one that
        # batches its calls (pdgate/meta_pooled.py) would send the item straight back into a batch.
        try:
            if isinstance(item, BatchCreate):
                body = HandoffCreate.model_validate(item.model_dump(exclude={"op"}))
                return await MetaClient.create_handoff(self, body)
            if isinstance(item, BatchReady):
                return await MetaClient.mark_ready(self, item.transfer_id, item.location)
            if isinstance(item, BatchClaim):
                return await MetaClient.claim(self, item.transfer_id, item.decode_instance_id, item.lease_s)
            if isinstance(item, BatchDone):
                return await MetaClient.done(self, item.transfer_id, item.decode_instance_id)
            return await MetaClient.abort(self, item.transfer_id, item.reason)
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
    """A 2xx answer the client cannot read (not JSON, not the contract's shape): a metaserver that does not
    speak this contract is as good as none, and the caller's rules for an unreachable one apply."""
    return MetaUnavailable(f"metaserver {method} {path} answered what this client cannot read: {exc!r:.200}")


def transport_error(exc: Exception, method: str, path: str) -> MetaError:
    """The `TRANSPORT_ERRORS` entry for `exc` (MetaUnavailable when none matches)."""
    for kind, (cls, what) in TRANSPORT_ERRORS.items():
        if isinstance(exc, kind):
            return cls(f"metaserver {method} {path} {what}: {exc!r}")
    return MetaUnavailable(f"metaserver {method} {path} failed: {exc!r}")


def _error_from(resp: httpx.Response, method: str, path: str) -> MetaError:
    return error_from_answer(resp.status_code, resp.content, method, path)


def _path(item: BatchItem) -> str:
    return "/v1/handoffs" if isinstance(item, BatchCreate) else f"/v1/handoffs/{item.transfer_id}/{item.op}"


def error_from_answer(status: int, content: bytes, method: str, path: str) -> MetaError:
    """Turn an RFC 7807 (or FastAPI `detail`) answer into the typed error for its status (`BY_STATUS`),
    carrying the body's `code` and `current_state`.

    Public so that a subclass of `MetaClient` with another HTTP layer (the router's pooled client)
    raises exactly the errors this client raises.
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

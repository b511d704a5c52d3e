"""LocalMetaClient: the `MetaAPI` of `pdgate.meta_client`, served in-process by a `MetaService`.

Why: the router's embedded mode runs the metaserver in its own process; going through HTTP to itself
would add a hop and a socket per call. This class has the same methods, arguments, return types and
typed exceptions as `MetaClient` (service errors subclass the client's `MetaError` tree), so code written
against `MetaAPI` cannot tell the two apart. Bodies are built as pydantic models here too, so invalid
input fails the same way (pydantic raises before anything reaches the store).

    async with running_service(settings) as service:      # metaserver.app
        meta: MetaAPI = LocalMetaClient(service)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdgate.metaserver.batch import run_batch
from pdgate.metaserver.service import MetaService

from pdgate.meta_client import MetaError
from pdgate.models import (
    BatchItem,
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HeartbeatResponse,
    Instance,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    RegisterResponse,
    Role,
)

__all__ = ["LocalMetaClient"]


class LocalMetaClient:
    def __init__(self, service: MetaService) -> None:
        self.service = service

    @property
    def base_url(self) -> str:
        return "local://"

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> LocalMetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def register(self, reg: InstanceRegistration) -> RegisterResponse:
        return await self.service.register(reg)

    async def heartbeat(self, instance_id: str, load: InstanceLoad | None = None) -> HeartbeatResponse:
        return await self.service.heartbeat(instance_id, load)

    async def drain(self, instance_id: str) -> Instance:
        return await self.service.drain(instance_id)

    async def deregister(self, instance_id: str) -> None:
        await self.service.deregister(instance_id)

    async def list_instances(
        self, *, role: Role | None = None, model: str | None = None, state: InstanceState | None = None
    ) -> list[Instance]:
        return await self.service.list_instances(role=role, model=model, state=state)

    async def get_instance(self, instance_id: str) -> Instance:
        return await self.service.get_instance(instance_id)

    async def create_handoff(self, body: HandoffCreate) -> Handoff:
        return await self.service.create_handoff(body)

    async def mark_ready(self, transfer_id: str, location: KVLocation) -> Handoff:
        return await self.service.mark_ready(transfer_id, location)

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff:
        return await self.service.claim(transfer_id, decode_instance_id, lease_s)

    async def done(self, transfer_id: str, decode_instance_id: str) -> Handoff:
        return await self.service.done(transfer_id, decode_instance_id)

    async def abort(self, transfer_id: str, reason: str) -> Handoff:
        return await self.service.abort(transfer_id, reason)

    async def batch(self, items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        return await run_batch(self.service, items) if items else []

    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff:
        return await self.service.get_handoff(transfer_id, wait)

    async def events(self, instance_id: str, cursor: str | None = None, wait: float | None = None) -> HandoffEvents:
        return await self.service.events(instance_id, cursor, wait)

    async def health(self) -> dict[str, Any]:
        return await self.service.health()

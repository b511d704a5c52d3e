"""Self-registration with the metaserver: the record we publish, and the loop that keeps it alive.

`build_registration` is pure (config + engine facts + worker addresses -> `InstanceRegistration`).
`Registrar` runs on the control thread's event loop: it registers (retrying with capped backoff while
the metaserver is unreachable, so engine start-up never waits for it), heartbeats with the current load,
re-registers when the metaserver forgot us (lease lapsed, metaserver restarted), and deregisters on a
clean shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from pdgate.connector.config import ConnectorConfig

from pdgate.meta_client import MetaAPI, MetaBadRequest, MetaError, MetaNotFound, MetaUnauthorized
from pdgate.models import (
    InstanceLoad,
    InstanceRegistration,
    RegisterResponse,
    Role,
    TransportAddress,
    TransportKind,
)

__all__ = ["Registrar", "backoff", "build_registration", "kv_layout_tag"]

logger = logging.getLogger(__name__)


def kv_layout_tag(
    *, layout: str, dtype: str, num_kv_heads: int, head_size: int, block_size: int, num_layers: int
) -> str:
    """The layout string P and D must share byte for byte: blocks are copied as opaque bytes, so every
    dimension of a block (and the attention layout inside it) has to agree. `num_kv_heads` is per TP rank;
    at unequal TP the tags differ in it alone, and `pdgate.pairing.layout_kv_heads` reads it back."""
    return f"{layout}/{dtype}/L{num_layers}/H{num_kv_heads}/D{head_size}/B{block_size}"


def build_registration(
    cfg: ConnectorConfig,
    *,
    dp_rank: int,
    dp_size: int,
    tp_size: int,
    pp_size: int,
    block_size: int,
    kv_dtype: str,
    kv_layout: str,
    kv_replicated: bool,
    engine_id: str | None,
    addresses: Sequence[TransportAddress],
) -> InstanceRegistration:
    return InstanceRegistration(
        id=cfg.instance_id,
        role=Role(cfg.role),
        url=cfg.url,
        model=cfg.model,
        dp_rank=dp_rank,
        dp_size=dp_size,
        tp_size=tp_size,
        pp_size=pp_size,
        block_size=block_size,
        kv_dtype=kv_dtype,
        kv_layout=kv_layout,
        kv_replicated=kv_replicated,
        transport=TransportKind(cfg.transport),
        transport_addresses=list(addresses),
        engine_id=engine_id,
        server_id=cfg.server_id,
        labels=dict(cfg.labels),
        lease_s=cfg.lease_s,
    )


def backoff(attempt: int, *, base: float = 0.2, cap: float = 5.0) -> float:
    """Capped exponential delay before retry `attempt` (0-based). Deterministic: no jitter source here."""
    return min(cap, base * float(1 << min(attempt, 16)))


class Registrar:
    """Keeps one registry record alive. Runs on the control loop; `run()` returns only when cancelled."""

    def __init__(
        self,
        client: MetaAPI,
        registration: InstanceRegistration,
        *,
        heartbeat_s: float,
        load: Callable[[], InstanceLoad | None],
        on_registered: Callable[[RegisterResponse], None],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        self._reg = registration
        self._heartbeat_s = heartbeat_s
        self._load = load
        self._on_registered = on_registered
        self._sleep = sleep
        self.registered = asyncio.Event()

    @property
    def instance_id(self) -> str:
        return self._reg.id

    async def run(self) -> None:
        while True:
            await self._register()
            await self._heartbeat_until_forgotten()

    async def deregister(self) -> None:
        try:
            await self._client.deregister(self._reg.id)
        except MetaNotFound:
            pass
        except MetaError as exc:
            logger.warning("instance %s: deregistration failed: %s", self._reg.id, exc)

    async def _register(self) -> None:
        attempt = 0
        while True:
            load = self._load()
            reg = self._reg if load is None else self._reg.model_copy(update={"load": load})
            try:
                resp = await self._client.register(reg)
            except (MetaBadRequest, MetaUnauthorized) as exc:
                # Our record or token is wrong: retrying fast will not fix it, but an operator might
                # (e.g. the token is rotated), so keep trying slowly and say why each time.
                logger.error("instance %s: the metaserver refused the registration: %s", reg.id, exc)
                await self._sleep(backoff(attempt, base=5.0, cap=60.0))
            except MetaError as exc:
                if attempt == 0 or attempt % 10 == 0:
                    logger.warning("instance %s: metaserver unreachable, will retry: %s", reg.id, exc)
                await self._sleep(backoff(attempt))
            else:
                logger.info("instance %s registered as %s (lease %.1fs)", reg.id, reg.role.value, resp.lease_s)
                self._on_registered(resp)
                self.registered.set()
                return
            attempt += 1

    async def _heartbeat_until_forgotten(self) -> None:
        failures = 0
        while True:
            await self._sleep(self._heartbeat_s)
            try:
                await self._client.heartbeat(self._reg.id, self._load())
            except MetaNotFound:
                logger.warning("instance %s: the metaserver forgot us; registering again", self._reg.id)
                self.registered.clear()
                return
            except MetaError as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    logger.warning("instance %s: heartbeat failed (%d in a row): %s", self._reg.id, failures, exc)
            else:
                failures = 0

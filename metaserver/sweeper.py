"""The sweeper: the only driver of lease expiry (* -> EXPIRED, and CLAIMED -> READY when a claim lapses).

Why a loop and not expiry on read: a READY record nobody reads must still expire, and its EXPIRED event
must reach the prefill's feed so the blocks are freed. Every metaserver replica runs one; the store's
`expire_due` re-checks each record atomically, so concurrent sweepers move each record once. A failing
store is logged and retried with a backoff; the loop never dies of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdgate.metaserver.service import MetaService

from pdgate.meta_client import MetaError

__all__ = ["Sweeper"]

log = logging.getLogger(__name__)

_REGISTRY_GAUGE_EVERY_S = 1.0


class Sweeper:
    def __init__(self, service: MetaService, *, interval_s: float) -> None:
        self.service = service
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        # A flag as well as cancel(): redis-py may turn a cancellation that lands inside a command into a
        # connection error, which the loop survives by design; the flag still ends it.
        self._stopping = False

    async def run_once(self) -> int:
        """Expire everything due now (in batches); the number of records moved."""
        total = 0
        while True:
            moved = await self.service.expire_due()
            total += len(moved)
            if len(moved) < 1000:
                return total

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_gauge = 0.0
        failures = 0
        while not self._stopping:
            try:
                await self.run_once()
                self.service.metrics.sweeps.inc()
                if loop.time() >= next_gauge:
                    svc = self.service
                    svc.metrics.registry_size.set(await svc.store.count_instances(now=svc.clock()))
                    next_gauge = loop.time() + _REGISTRY_GAUGE_EVERY_S
                if failures:
                    log.info("sweeper: store reachable again")
                failures = 0
                delay = self.interval_s
            except MetaError as exc:
                failures += 1
                self.service.metrics.store_errors.labels("sweeper").inc()
                if failures == 1 or failures % 50 == 0:
                    log.warning("sweeper: %s (attempt %d)", exc.detail, failures)
                delay = min(self.interval_s * (2 ** min(failures, 5)), 2.0)
            except Exception:
                failures += 1
                log.exception("sweeper: unexpected error")
                delay = 1.0
            await asyncio.sleep(delay)

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._loop(), name="pdgate-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

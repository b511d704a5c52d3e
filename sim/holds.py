"""pdgate-sim's prefill holds: the KV blocks a prefill keeps for each READY handoff, and when it frees them.

Why the simulator keeps them: the chaos suite must prove that no fault leaves prefill memory held, and a
fake engine that frees nothing (or everything at once) could not show it. The rules are the connector's
(`pdgate.connector.scheduler`): a prefill holds a handoff's blocks from READY until the ledger says the
record is terminal (its event feed), until a check finds the record terminal or gone (a store that lost
it), or, while the metaserver cannot be asked at all, until a local deadline (lease + margin).

`GET /sim/stats` reports `held_blocks`, `held_handoffs` and `freed` (counts by reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdgate.meta_client import MetaClient, MetaError, MetaNotFound

__all__ = ["Holds"]

log = logging.getLogger("pdgate.sim")

_CHECK_EVERY_S = 0.5


@dataclass
class _Hold:
    blocks: int
    meta_url: str
    lease_s: float
    held_at: float
    next_check_at: float


class Holds:
    """Blocks held per transfer id; `run()` frees them from the event feeds, checks and the local deadline."""

    def __init__(self, margin_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.held: dict[str, _Hold] = {}
        self.freed: dict[str, int] = {}
        self.margin_s = margin_s
        self.clock = clock

    def hold(self, transfer_id: str, blocks: int, meta_url: str, lease_s: float) -> None:
        now = self.clock()
        self.held[transfer_id] = _Hold(blocks, meta_url, lease_s, now, now + lease_s)

    def free(self, transfer_id: str, reason: str) -> None:
        if self.held.pop(transfer_id, None) is not None:
            self.freed[reason] = self.freed.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "held_blocks": sum(h.blocks for h in self.held.values()),
            "held_handoffs": len(self.held),
            "freed": dict(self.freed),
        }

    async def follow(self, meta: MetaClient, instance_id: str) -> None:
        """Free on the terminal events of one instance's feed (forever; cancelled at shutdown)."""
        cursor: str | None = None
        while True:
            try:
                batch = await meta.events(instance_id, cursor, wait=1.0)
            except MetaError as exc:
                # A store that restarted empty forgot the feed and its cursor: start again from now.
                cursor = None if exc.code == "invalid_cursor" else cursor
                await asyncio.sleep(0.2)
                continue
            cursor = batch.cursor
            for ev in batch.events:
                if ev.state.terminal:
                    self.free(ev.transfer_id, "event")

    async def check(self, meta_for: Callable[[str], MetaClient]) -> None:
        """Ask about holds older than their lease (a lost event or a lost record); forever."""
        while True:
            await asyncio.sleep(_CHECK_EVERY_S)
            now = self.clock()
            for tid, h in list(self.held.items()):
                if now < h.next_check_at:
                    continue
                h.next_check_at = now + _CHECK_EVERY_S
                try:
                    rec = await meta_for(h.meta_url).get_handoff(tid)
                except MetaNotFound:
                    self.free(tid, "record_lost")
                    continue
                except MetaError:
                    if self.clock() - h.held_at > h.lease_s + self.margin_s:
                        log.warning("handoff %s: metaserver unreachable past the lease; freeing locally", tid)
                        self.free(tid, "local_deadline")
                    continue
                if rec.state.terminal:
                    self.free(tid, "checked")
                else:
                    h.next_check_at = now + h.lease_s

    @staticmethod
    async def stop(tasks: list[asyncio.Task[None]]) -> None:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

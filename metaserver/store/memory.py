"""MemoryStore: the embedded store for one process (dicts under one asyncio.Lock).

Why it exists: a single router with the metaserver in-process needs no Redis. It applies the pure cores
(`ledger`, `registry`) under a lock, so its semantics are by construction the ones the Redis Lua scripts
must match (the contract suite runs against both). Deadlines sit in heaps with lazy deletion, so a sweep
costs O(due), not O(records).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable

from pdgate.metaserver import ledger, registry
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound
from pdgate.metaserver.guards import check_cursor
from pdgate.metaserver.store.base import LIVE_STATES, LedgerPolicy, Moved, Store

from pdgate.models import (
    TERMINAL_STATES,
    Handoff,
    HandoffCreate,
    HandoffEvent,
    HandoffEvents,
    HandoffState,
    Instance,
    InstanceLoad,
    InstanceState,
    KVLocation,
)

__all__ = ["MemoryStore", "feed_seed"]


def feed_seed(now: float) -> int:
    """First sequence number of a fresh event feed: epoch seconds << 20 (see `_Feed`). Stays below 2^53
    until the year 2242. (kv_keys have their own clock floor: `ledger.kv_key_floor`.)"""
    return int(now) << 20


class _Feed:
    """One prefill instance's terminal events: bounded, with a monotonically increasing sequence.

    The sequence starts from the clock (like a Redis stream id), so a cursor kept by a prefill across a
    restart of this store, or across the feed being dropped while idle, is never ahead of new events.
    """

    def __init__(self, maxlen: int, now: float) -> None:
        self.items: deque[tuple[int, HandoffEvent]] = deque(maxlen=maxlen)
        self.seq = feed_seed(now)
        self.last_append = now
        self.signal = asyncio.Event()

    def append(self, event: HandoffEvent, now: float) -> None:
        self.seq += 1
        self.items.append((self.seq, event))
        self.last_append = now
        self.signal.set()
        self.signal = asyncio.Event()


class MemoryStore(Store):
    def __init__(
        self, url: str = "memory://", *, policy: LedgerPolicy | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.url = url
        self.policy = policy or LedgerPolicy()
        self._lock = asyncio.Lock()
        self._instances: dict[str, Instance] = {}
        self._handoffs: dict[str, Handoff] = {}
        self._clock = clock
        self._kv_key = 0  # the last kv_key issued; each create takes max(last + 1, ledger.kv_key_floor)
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, tiebreak, transfer_id), lazily invalidated
        self._vanish: list[tuple[float, int, str]] = []  # terminal records: (drop at, tiebreak, transfer_id)
        self._tiebreak = itertools.count()
        self._feeds: dict[str, _Feed] = {}
        self._feed_created = asyncio.Event()
        self._left_pending: dict[str, asyncio.Event] = {}
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._closed = True

    # -- registry ----------------------------------------------------------------------------
    async def register(self, inst: Instance, *, now: float) -> Instance:
        async with self._lock:
            inst = registry.reregister(inst, self._instances.get(inst.id), now=now)
            self._instances[inst.id] = inst
            return inst

    def _live(self, instance_id: str, now: float) -> Instance | None:
        inst = self._instances.get(instance_id)
        if inst is None:
            return None
        if not registry.is_live(inst, now):
            del self._instances[instance_id]
            return None
        return inst

    async def heartbeat(self, instance_id: str, load: InstanceLoad | None, *, now: float) -> Instance | None:
        async with self._lock:
            inst = self._live(instance_id, now)
            if inst is None:
                return None
            inst = registry.renew(inst, now=now, load=load)
            self._instances[instance_id] = inst
            return inst

    async def drain(
        self, instance_id: str, *, now: float, state: InstanceState = InstanceState.DRAINING
    ) -> Instance | None:
        async with self._lock:
            inst = self._live(instance_id, now)
            if inst is None:
                return None
            inst = registry.start_drain(inst) if state is InstanceState.DRAINING else registry.end_drain(inst)
            self._instances[instance_id] = inst
            return inst

    async def deregister(self, instance_id: str) -> bool:
        async with self._lock:
            return self._instances.pop(instance_id, None) is not None

    async def get_instance(self, instance_id: str, *, now: float) -> Instance | None:
        async with self._lock:
            return self._live(instance_id, now)

    async def list_instances(self, *, now: float) -> list[Instance]:
        async with self._lock:
            for iid in [i for i, inst in self._instances.items() if not registry.is_live(inst, now)]:
                del self._instances[iid]
            return sorted(self._instances.values(), key=lambda i: i.id)

    async def count_instances(self, *, now: float) -> int:
        return len(await self.list_instances(now=now))

    # -- ledger ------------------------------------------------------------------------------
    def _push_deadline(self, rec: Handoff) -> None:
        if rec.deadline is not None:
            heapq.heappush(self._deadlines, (rec.deadline, next(self._tiebreak), rec.transfer_id))

    def _store(self, before: HandoffState, rec: Handoff, now: float) -> Moved:
        """Write a moved record and its side effects (deadline, feed, wake-ups): the one place they happen."""
        self._handoffs[rec.transfer_id] = rec
        if rec.state in TERMINAL_STATES:
            heapq.heappush(self._vanish, (now + self.policy.terminal_ttl_s, next(self._tiebreak), rec.transfer_id))
            self._feed(rec.prefill_instance_id).append(ledger.event_for(rec), now)
        else:
            self._push_deadline(rec)
        if before is ledger.FIRST_STATE and rec.state is not ledger.FIRST_STATE:
            waker = self._left_pending.pop(rec.transfer_id, None)
            if waker is not None:
                waker.set()
        return Moved(before, rec)

    def _feed(self, instance_id: str) -> _Feed:
        feed = self._feeds.get(instance_id)
        if feed is None:
            feed = self._feeds[instance_id] = _Feed(self.policy.events_maxlen, self._clock())
            self._feed_created.set()  # wakes polls of an instance that had no feed yet
            self._feed_created = asyncio.Event()
        return feed

    def _get(self, transfer_id: str) -> Handoff:
        rec = self._handoffs.get(transfer_id)
        if rec is None:
            raise HandoffNotFound(f"handoff {transfer_id} not found")
        return rec

    async def create_handoff(
        self, body: HandoffCreate, *, transfer_id: str, now: float, pending_lease_s: float, ready_lease_s: float
    ) -> Handoff:
        async with self._lock:
            if transfer_id in self._handoffs:
                raise HandoffExists(
                    f"handoff {transfer_id} already exists", current_state=self._handoffs[transfer_id].state
                )
            self._kv_key = max(self._kv_key + 1, ledger.kv_key_floor(self._clock()))
            rec = ledger.create(
                body,
                transfer_id=transfer_id,
                kv_key=self._kv_key,
                now=now,
                pending_lease_s=pending_lease_s,
                ready_lease_s=ready_lease_s,
            )
            self._handoffs[transfer_id] = rec
            self._push_deadline(rec)
            return rec

    async def get_handoff(self, transfer_id: str) -> Handoff | None:
        return self._handoffs.get(transfer_id)

    async def mark_ready(
        self, transfer_id: str, location: KVLocation, *, now: float, engine: str | None = None
    ) -> Moved:
        async with self._lock:
            rec = self._get(transfer_id)
            if engine is not None or location.engine_id is not None:
                prefill = self._live(rec.prefill_instance_id, now) if location.engine_id is not None else None
                registered = prefill.engine_id if prefill is not None else None
                ledger.check_ready(
                    rec.prefill_instance_id, engine=engine, engine_id=location.engine_id, registered=registered
                )
            return self._store(rec.state, ledger.mark_ready(rec, location, now=now), now)

    async def claim(self, transfer_id: str, decode_instance_id: str, *, now: float, lease_s: float) -> Moved:
        async with self._lock:
            rec = self._get(transfer_id)
            return self._store(rec.state, ledger.claim(rec, decode_instance_id, now=now, lease_s=lease_s), now)

    async def done(self, transfer_id: str, decode_instance_id: str | None, *, now: float) -> Moved:
        async with self._lock:
            rec = self._get(transfer_id)
            return self._store(rec.state, ledger.done(rec, decode_instance_id, now=now), now)

    async def abort(self, transfer_id: str, reason: str, *, now: float) -> Moved:
        async with self._lock:
            rec = self._get(transfer_id)
            return self._store(rec.state, ledger.abort(rec, reason, now=now), now)

    async def expire_due(self, *, now: float, limit: int = 1000) -> list[Moved]:
        moved: list[Moved] = []
        async with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now and len(moved) < limit:
                deadline, _, tid = heapq.heappop(self._deadlines)
                rec = self._handoffs.get(tid)
                if rec is None or rec.deadline != deadline:
                    continue  # stale heap entry: the record moved on since
                nxt = ledger.lapse(rec, now=now, max_claims=self.policy.max_claims)
                if nxt is not None:
                    moved.append(self._store(rec.state, nxt, now))
            while self._vanish and self._vanish[0][0] <= now:
                _, _, tid = heapq.heappop(self._vanish)
                rec = self._handoffs.get(tid)
                if rec is not None and rec.state in TERMINAL_STATES:
                    del self._handoffs[tid]
            idle = [iid for iid, f in self._feeds.items() if f.last_append + self.policy.events_ttl_s <= now]
            for iid in idle:
                del self._feeds[iid]
        return moved

    async def list_live_handoffs(self, *, state: HandoffState | None, limit: int) -> list[Handoff]:
        live = [r for r in self._handoffs.values() if r.state in LIVE_STATES and (state is None or r.state is state)]
        return sorted(live, key=lambda r: (r.deadline or 0.0, r.transfer_id))[:limit]

    async def count_handoffs_by_state(self) -> dict[HandoffState, int]:
        counts = dict.fromkeys(LIVE_STATES, 0)
        for rec in self._handoffs.values():
            if rec.state in counts:
                counts[rec.state] += 1
        return counts

    async def wait_handoff(self, transfer_id: str, *, timeout: float) -> Handoff | None:
        rec = self._handoffs.get(transfer_id)
        if rec is None or rec.state is not HandoffState.PENDING or timeout <= 0:
            return rec
        # Every PENDING record leaves PENDING eventually (its lease lapses), which pops this event.
        waker = self._left_pending.setdefault(transfer_id, asyncio.Event())
        try:
            await asyncio.wait_for(waker.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self._handoffs.get(transfer_id)

    async def read_events(
        self, instance_id: str, cursor: str | None, *, wait: float, limit: int = 1000
    ) -> HandoffEvents:
        # One grammar for both stores (`<n>` or `<n>-<m>`); a feed's sequence is one number.
        checked = check_cursor(cursor)
        after = int(checked.partition("-")[0]) if checked is not None else 0
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            # A poll never creates a feed: polling an unknown instance must leave nothing behind.
            feed = self._feeds.get(instance_id)
            if feed is not None:
                batch = [(seq, ev) for seq, ev in feed.items if seq > after][:limit]
                if batch:
                    return HandoffEvents(events=[ev for _, ev in batch], cursor=str(batch[-1][0]))
            remaining = until - loop.time()
            if remaining <= 0:
                return HandoffEvents(events=[], cursor=cursor if cursor is not None else "0")
            # Re-check at least every second: the feed may have been dropped and recreated meanwhile.
            signal = feed.signal if feed is not None else self._feed_created
            try:
                await asyncio.wait_for(signal.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

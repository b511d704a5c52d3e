"""`Batcher`: ledger calls made one at a time by their callers go to the metaserver as batches.

Why: a caller that makes many ledger calls at once (an engine's control thread: every READY, claim or
DONE of a step; the router: one create and one claim per request) would otherwise send one HTTP
request per call, and under load they queue behind each other. Each `call()` here queues its item and
waits for its own outcome; a request carries every item queued when it goes out (`POST
/v1/handoffs/batch`, see `pdgate.metaserver.batch`). At most `max_in_flight` requests are out at once:
a lone call goes at once, and calls arriving while the requests are out ride together in the next one,
so a burst costs a few requests, never one round trip per call after the other.

A request holds at most `max_items` items (the metaserver's `MAX_BATCH_ITEMS`) and at most `max_bytes`
of body (its default body limit, `pdgate.models.MAX_BODY_BYTES`): READYs carry the transport's
per-rank descriptors (NIXL agent metadata: about 66 KB for 8 TP ranks), so 24 of them in one request
passed the limit and all got 413. An item larger than a request may be goes in a request of its own;
a 413 that still comes (a metaserver configured below the default) is `MetaClient.batch`'s to split.

Each caller still sees exactly what its single call would raise: the item's own typed `MetaError`, or
the request's (e.g. `MetaUnavailable` for every item of a request that could not be sent), so retry
rules written against the single calls stay as they are.

`snapshot()` gives the queue depth and the per-call latency (queued -> answered) for stats and logs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pdgate.meta_client import MetaError
from pdgate.models import MAX_BATCH_ITEMS, MAX_BODY_BYTES, BatchItem, Handoff

__all__ = ["Batcher", "SendBatch"]

SendBatch = Callable[[Sequence[BatchItem]], Awaitable[list[Handoff | MetaError]]]

_WINDOW = 4096  # latencies kept for percentiles
_ENVELOPE = 64  # bytes of a batch body beyond its items' own (`{"items":[...]}`, commas), with room to spare

_Entry = tuple[BatchItem, "asyncio.Future[Handoff]", float, int]  # item, its caller, queued at, its bytes


def item_bytes(item: BatchItem) -> int:
    """The bytes `item` adds to a batch body: its JSON as `MetaClient.batch` sends it, plus a comma."""
    return len(item.model_dump_json(exclude_none=True)) + 1


def _copy(exc: MetaError) -> MetaError:
    """One error per waiting caller (an exception object raised in several tasks would share a traceback)."""
    return type(exc)(exc.detail, code=exc.code, status=exc.status, current_state=exc.current_state)


class Batcher:
    """Queue of ledger calls, sent as batches by `send` (usually `MetaClient.batch`). One event loop."""

    def __init__(
        self,
        send: SendBatch,
        *,
        max_in_flight: int = 2,
        max_items: int = MAX_BATCH_ITEMS,
        max_bytes: int = MAX_BODY_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_in_flight < 1 or not 1 <= max_items <= MAX_BATCH_ITEMS or max_bytes <= _ENVELOPE:
            raise ValueError("max_in_flight >= 1, 1 <= max_items <= MAX_BATCH_ITEMS and max_bytes > 64")
        self._send = send
        self.max_in_flight = max_in_flight
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._clock = clock
        self._queue: deque[_Entry] = deque()
        self._scheduled = False
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # stats (see snapshot())
        self.calls = 0
        self.requests = 0
        self.depth_max = 0
        self._latencies: deque[float] = deque(maxlen=_WINDOW)
        self._rtts: deque[float] = deque(maxlen=_WINDOW)

    @property
    def depth(self) -> int:
        """Calls queued and not yet sent."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def call(self, item: BatchItem) -> Handoff:
        """The record after `item`'s move, or the `MetaError` its single call would raise."""
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut, self._clock(), item_bytes(item)))
        self.depth_max = max(self.depth_max, len(self._queue))
        self._schedule()
        return await fut

    def _schedule(self) -> None:
        # On the next loop turn, so that every call made in this turn (one engine step's commands) rides along.
        if not self._scheduled and self._queue and self._in_flight < self.max_in_flight:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        while self._queue and self._in_flight < self.max_in_flight:
            batch: list[_Entry] = []
            room = self.max_bytes - _ENVELOPE  # an item larger than that alone goes alone
            while self._queue and len(batch) < self.max_items:
                entry = self._queue[0]
                if batch and entry[3] > room:
                    break  # the next request takes it
                self._queue.popleft()
                if not entry[1].done():  # a caller that gave up (cancelled) is not sent
                    batch.append(entry)
                    room -= entry[3]
            if not batch:
                return
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._request(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _request(self, batch: list[_Entry]) -> None:
        sent = self._clock()
        try:
            outcomes: list[Handoff | MetaError] | MetaError = await self._send([entry[0] for entry in batch])
        except MetaError as exc:
            outcomes = exc
        except Exception as exc:  # a bug in `send`: every caller hears it rather than waiting forever
            for _, fut, _, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            raise
        finally:
            self._in_flight -= 1
            self._schedule()
        now = self._clock()
        self.requests += 1
        self._rtts.append(now - sent)
        for i, (_, fut, queued, _) in enumerate(batch):
            self.calls += 1
            self._latencies.append(now - queued)
            if fut.done():
                continue
            outcome = outcomes if isinstance(outcomes, MetaError) else outcomes[i]
            if isinstance(outcome, MetaError):
                fut.set_exception(_copy(outcome) if outcome is outcomes else outcome)
            else:
                fut.set_result(outcome)

    def snapshot(self, *, reset: bool = False) -> dict[str, Any]:
        """Queue depth (now, and the most since the last reset), calls, requests and latencies in ms."""
        snap: dict[str, Any] = {
            "queue_depth": len(self._queue),
            "queue_depth_max": self.depth_max,
            "in_flight": self._in_flight,
            "calls": self.calls,
            "requests": self.requests,
            "call_ms": _percentiles(self._latencies),
            "request_ms": _percentiles(self._rtts),
        }
        if reset:
            self.depth_max = len(self._queue)
            self._latencies.clear()
            self._rtts.clear()
        return snap

    async def aclose(self) -> None:
        """Wait for the requests in flight (cancelled callers are not waited for)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _percentiles(values: Sequence[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    n = len(ordered)

    def at(q: float) -> float:
        return round(ordered[min(n - 1, int(q * n))] * 1000.0, 3)

    return {"n": n, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(ordered[-1] * 1000.0, 3)}

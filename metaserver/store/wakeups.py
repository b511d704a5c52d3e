"""Waking long-polls (`RedisStore.wait_handoff`) when a handoff leaves PENDING.

The scripts announce each transfer id that leaves PENDING (`left_pending` in lua/_lib.lua). On one
Redis (plain or Sentinel) that is a `PUBLISH` on one channel, heard by one subscriber per store. On a
Redis Cluster a plain `PUBLISH` is broadcast to every node over the cluster bus, so every node would pay
for every request whatever its share of the ledger: there each shard announces on its own shard
channel (`SPUBLISH`, Redis 7), and the store subscribes once per master to the channels of the buckets
it serves. A slot that moves ends its subscription (Redis sends `sunsubscribe`), and the listener
rebuilds them all from a fresh slot map. Waiters also re-read the record every `RECHECK_S`, so a
message lost to an outage or a migration only delays a wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from pdgate.metaserver.store.keys import Keys
from redis.asyncio.cluster import ClusterNode, RedisCluster

__all__ = ["RECHECK_S", "Wakeups"]

log = logging.getLogger(__name__)

RECHECK_S = 0.5  # a waiter re-reads its record this often, message or not


class Wakeups:
    """The waiters of one store, and the one listener task that sets their events."""

    def __init__(self, client: Any, keys: Keys, closing: Callable[[], bool]) -> None:
        self._client = client  # the store's blocking client (no socket timeout)
        self._keys = keys
        self._closing = closing
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, transfer_id: str) -> asyncio.Event:
        if not self._closing() and (self._task is None or self._task.done()):
            listen = self._listen_sharded if isinstance(self._client, RedisCluster) else self._listen
            self._task = asyncio.create_task(listen(), name="pdgate-left-pending")
        event = asyncio.Event()
        self._waiters.setdefault(transfer_id, set()).add(event)
        return event

    def unwatch(self, transfer_id: str, event: asyncio.Event) -> None:
        waiting = self._waiters.get(transfer_id)
        if waiting is not None:
            waiting.discard(event)
            if not waiting:
                del self._waiters[transfer_id]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def _wake(self, transfer_id: str) -> None:
        for event in self._waiters.get(transfer_id, ()):
            event.set()

    async def _listen(self) -> None:
        """One channel on one Redis; survive outages. Ends on `closing()` too: redis-py may turn a
        cancellation inside a read into a connection error."""
        while not self._closing():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._keys.left_pending)
                while not self._closing():
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._wake(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the waiters fall back to re-reading; try again shortly
                log.debug("left-pending listener: %r; resubscribing", exc)
                await asyncio.sleep(RECHECK_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _listen_sharded(self) -> None:
        """Cluster: one shard-channel subscription per master, rebuilt when any of them ends."""
        cluster: RedisCluster = self._client
        while not self._closing():
            tasks: list[asyncio.Task[None]] = []
            try:
                await cluster.initialize()
                by_node: dict[str, tuple[ClusterNode, list[str]]] = {}
                for shard in self._keys.shards:
                    node = cluster.get_node_from_key(shard.left_pending)
                    if node is None:
                        raise LookupError(f"no master serves {shard.left_pending}")
                    by_node.setdefault(node.name, (node, []))[1].append(shard.left_pending)
                tasks = [asyncio.create_task(self._listen_node(n, chans)) for n, chans in by_node.values()]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        log.debug("left-pending shard listener: %r; resubscribing", task.exception())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("left-pending shard listeners: %r; resubscribing", exc)
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if not self._closing():
                await asyncio.sleep(RECHECK_S)
                # Slots may have moved: make the client learn the map again before resubscribing.
                with contextlib.suppress(Exception):
                    await cluster.nodes_manager.initialize()

    async def _listen_node(self, node: ClusterNode, channels: list[str]) -> None:
        """SSUBSCRIBE this master's shard channels; returns when one of them moves away."""
        pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
        client = aioredis.Redis(connection_pool=pool)
        pubsub = client.pubsub()
        try:
            for channel in channels:  # one command per channel: SSUBSCRIBE names channels of one slot
                await pubsub.ssubscribe(channel)
            while not self._closing():
                msg = await pubsub.get_message(timeout=1.0)
                if msg is None:
                    continue
                if msg["type"] == "smessage":
                    self._wake(msg["data"])
                elif msg["type"] == "sunsubscribe":  # the slot moved: rebuild from the new map
                    return
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # annotated from redis-py 8
            with contextlib.suppress(Exception):
                await client.aclose(close_connection_pool=True)

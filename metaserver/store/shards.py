"""Finding a handoff's shard on a Redis Cluster, and reading a stream there in one round trip.

Why a locator: the ledger is sharded by prefill (`keys.py`), but a move names only the transfer id.
Before the create script writes the record, the store claims `PREFIX:loc:{<transfer_id>}` (SET NX)
with the record's bucket, so a second record with that id can never appear in another shard, and any
metaserver replica can find the record later with one GET. Each store remembers the locators it wrote
or read (bounded, newest kept), so a move on the replica that made the record is still one round trip;
a balancer that routes `/v1/handoffs/{id}` by id keeps it so on every replica (docs/SCALE.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pdgate.metaserver.store.keys import LOCATOR_LIVE_S, Keys, ShardKeys, ttl_ms
from redis.asyncio.cluster import RedisCluster

__all__ = ["Locator", "xread"]

_CACHE = 65536  # transfer id -> bucket entries kept per store


class Locator:
    """transfer id -> shard, for one store. The callers wrap these calls in the store's error mapping."""

    def __init__(self, keys: Keys, client: Any, terminal_ttl_s: float) -> None:
        self._keys = keys
        self._client = client
        self._ttl_ms = ttl_ms(terminal_ttl_s + LOCATOR_LIVE_S)
        self._known: OrderedDict[str, int] = OrderedDict()

    async def find(self, transfer_id: str) -> ShardKeys | None:
        """The shard holding this handoff; None when no locator names it (an unknown id)."""
        if not self._keys.sharded:
            return self._keys.shards[0]
        bucket = self._known.get(transfer_id)
        if bucket is None:
            found = await self._client.get(self._keys.locator(transfer_id))
            if found is None:
                return None
            bucket = int(found)
            self._remember(transfer_id, bucket)
        return self._keys.shards[bucket]

    async def claim(self, transfer_id: str, bucket: int) -> bool:
        """Point the id at `bucket` unless it already points elsewhere (False: the id is taken)."""
        locator = self._keys.locator(transfer_id)
        old = await self._client.set(locator, bucket, nx=True, get=True, px=self._ttl_ms)
        if old is not None and int(old) != bucket:
            return False
        self._remember(transfer_id, bucket)
        return True

    def _remember(self, transfer_id: str, bucket: int) -> None:
        self._known[transfer_id] = bucket
        if len(self._known) > _CACHE:
            self._known.popitem(last=False)


async def xread(client: Any, key: str, after: str, limit: int, block: int | None) -> Any:
    """XREAD of one stream. On a cluster it goes straight to the stream's node: redis-py cannot find
    XREAD's key by itself (the command's keys move with its arguments) and would ask the server with an
    extra COMMAND GETKEYS round trip on every read."""
    if not isinstance(client, RedisCluster):
        return await client.xread({key: after}, count=limit, block=block)
    args: list[Any] = ["XREAD", "COUNT", limit]
    if block is not None:
        args += ["BLOCK", block]
    node = client.get_node_from_key(key)
    return await client.execute_command(*args, "STREAMS", key, after, target_nodes=node)

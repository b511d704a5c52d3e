"""Every Redis key and TTL of the metaserver, formatted here and nowhere else.

Key layout (PREFIX defaults to `pdgate`, set with `...?prefix=NAME`). The ledger lives in one or more
*shards*; SHARD below is a shard's hash tag. On one Redis (plain or Sentinel) there is one shard,
`{PREFIX}`; on a Redis Cluster there are `buckets` of them (`{PREFIX:N}`, one tag per bucket, default 64), and a handoff
lives in the shard of its prefill instance (`Keys.bucket_of`):

    SHARD:h:<transfer_id>        hash   one handoff record (fields named as in models.Handoff); terminal
                                        records expire after terminal_ttl_s (default 600)
    SHARD:deadlines              zset   transfer_id -> lease deadline of every live handoff of the shard
    SHARD:handoff-states         hash   state -> number of live handoffs of the shard in it, moved by the
                                        same script step that moves a record (read by /metrics, summed)
    SHARD:kv_key                 string the shard's kv_key counter (create.lua: never below the clock floor)
    SHARD:ev:<instance_id>       stream terminal events of the handoffs whose prefill is that instance;
                                        XADD MAXLEN ~ events_maxlen (default 10000: a prefill that falls
                                        further behind misses the oldest), expires events_ttl_s after the
                                        last event
    PREFIX:loc:{<transfer_id>}   string cluster only: the bucket of a handoff (moves name only the id);
                                        written before the record, expires LOCATOR_LIVE_S after the
                                        terminal TTL
    {PREFIX}:i:<instance_id>     hash   one registry record (expires with its lease, plus a grace)
    {PREFIX}:instances           zset   instance_id -> heartbeat lease deadline (listing without KEYS scans)
    {PREFIX}:left-pending        pubsub channel: transfer ids that just left PENDING (wakes long-polls);
    SHARD:left-pending           cluster only, instead: the shard's own channel (SPUBLISH, wakeups.py)

Why a shard per prefill and not per transfer id: each transition script must update, in the same
atomic step, the record, the deadline index and the prefill's event stream. Redis Cluster runs a script
only over keys of one slot, so those keys must share a slot; with a per-transfer tag the index and the
stream would live elsewhere and the step would stop being atomic. Prefills are hashed into a fixed
number of buckets rather than one tag each, so the sweeper and the per-state gauges visit a known,
bounded set of shards. Each bucket's tag is chosen so its hash slot falls in the bucket's share of the
16384 slots (`_slot_tags`): buckets spread evenly over masters that own contiguous slot ranges, which is
how `redis-cli --cluster create` lays them out. The registry is small and stays in one slot. Scripts
derive every other key of a shard from KEYS[1] (the shard's deadline index) and the suffixes below.
"""

from __future__ import annotations

import math
import re
import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = ["DEFAULT_PREFIX", "LOCATOR_LIVE_S", "Keys", "ShardKeys", "ttl_ms"]

DEFAULT_PREFIX = "pdgate"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")

# Instance keys outlive their lease by this much, so the key never vanishes before the lease check
# (done with the caller's clock) says the instance lapsed; the lease, not the TTL, decides liveness.
INSTANCE_TTL_GRACE_S = 1.0

# Cluster only: how long a handoff may stay live (not terminal) and still be found by its id. Leases are
# seconds to minutes; a bound keeps the locators' memory to (rate x (this + terminal TTL)) keys.
LOCATOR_LIVE_S = 900.0

# Suffixes after a shard's tag and ':' (the Lua scripts read them from CFG).
DEADLINES = "deadlines"
HANDOFF = "h:"
EVENTS = "ev:"
STATE_COUNTS = "handoff-states"
KV_COUNTER = "kv_key"
LEFT_PENDING = "left-pending"


def ttl_ms(seconds: float) -> int:
    """A TTL in whole milliseconds, never zero (PEXPIRE 0 would delete at once)."""
    return max(1, math.ceil(seconds * 1000))


def _slot_tags(prefix: str, buckets: int) -> list[str]:
    """One hash tag per bucket, each in its bucket's share of the slots: `PREFIX:N` for the first N whose
    slot falls there (a single pass; about buckets x ln(buckets) tries, done once per store)."""
    tags: list[str | None] = [None] * buckets
    missing, n = buckets, 0
    while missing:
        tag = f"{prefix}:{n}"
        bucket = key_slot(tag.encode()) * buckets // REDIS_CLUSTER_HASH_SLOTS
        if tags[bucket] is None:
            tags[bucket] = tag
            missing -= 1
        n += 1
    return [t for t in tags if t is not None]


class ShardKeys:
    """The ledger keys of one shard (one hash slot)."""

    def __init__(self, tag: str, bucket: int) -> None:
        self.bucket = bucket
        self.base = "{" + tag + "}:"
        self.deadlines = self.base + DEADLINES
        self.handoff_prefix = self.base + HANDOFF
        self.events_prefix = self.base + EVENTS
        self.state_counts = self.base + STATE_COUNTS
        self.kv_counter = self.base + KV_COUNTER
        self.left_pending = self.base + LEFT_PENDING  # cluster: the shard's own channel (SPUBLISH)

    def handoff(self, transfer_id: str) -> str:
        return self.handoff_prefix + transfer_id

    def events(self, instance_id: str) -> str:
        return self.events_prefix + instance_id


class Keys:
    """Key names for one namespace; `buckets` > 1 shards the ledger (Redis Cluster)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, *, buckets: int = 1) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"redis key prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        if not 1 <= buckets <= 1024:
            raise ValueError(f"buckets must be 1..1024, not {buckets}")
        self.prefix = prefix
        tag = "{" + prefix + "}"
        self.shards: tuple[ShardKeys, ...]
        if buckets == 1:
            self.shards = (ShardKeys(prefix, 0),)
        else:
            self.shards = tuple(ShardKeys(tag, b) for b, tag in enumerate(_slot_tags(prefix, buckets)))
        one = self.shards[0]
        # The single shard's names (what one Redis holds; kept for tools and tests of that layout).
        self.handoff_prefix = one.handoff_prefix
        self.events_prefix = one.events_prefix
        self.deadlines = one.deadlines
        self.kv_counter = one.kv_counter
        self.state_counts = one.state_counts
        self.instance_prefix = f"{tag}:i:"
        self.instances = f"{tag}:instances"
        self.left_pending = f"{tag}:left-pending"
        self.locator_prefix = f"{prefix}:loc:"

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def bucket_of(self, prefill_instance_id: str) -> int:
        """The shard of every handoff of this prefill: CRC-32 of its id (the same on every replica)."""
        if len(self.shards) == 1:
            return 0
        return zlib.crc32(prefill_instance_id.encode()) % len(self.shards)

    def shard_of(self, prefill_instance_id: str) -> ShardKeys:
        return self.shards[self.bucket_of(prefill_instance_id)]

    def locator(self, transfer_id: str) -> str:
        return self.locator_prefix + "{" + transfer_id + "}"

    def handoff(self, transfer_id: str) -> str:
        return self.handoff_prefix + transfer_id

    def events(self, instance_id: str) -> str:
        return self.shard_of(instance_id).events(instance_id)

    def instance(self, instance_id: str) -> str:
        return self.instance_prefix + instance_id

    def instance_ttl_ms(self, lease_s: float) -> int:
        return ttl_ms(lease_s + INSTANCE_TTL_GRACE_S)

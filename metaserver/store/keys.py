"""Every Redis key and TTL of the metaserver, formatted here and nowhere else.

Key layout (PREFIX defaults to `pdgate`, set with `redis://...?prefix=NAME`):

    {PREFIX}:h:<transfer_id>     hash   one handoff record (fields named as in models.Handoff); terminal
                                        records expire after terminal_ttl_s (default 600)
    {PREFIX}:deadlines           zset   transfer_id -> lease deadline of every live (non-terminal) handoff
    {PREFIX}:handoff-states      hash   state -> number of live handoffs in it (PENDING/READY/CLAIMED), moved by
                                        the same script step that moves a record (read by /metrics)
    {PREFIX}:kv_key              string the kv_key counter (INCR; seeded from the clock, see memory.kv_key_seed)
    {PREFIX}:ev:<instance_id>    stream terminal events of the handoffs whose prefill is that instance;
                                        XADD MAXLEN ~ events_maxlen (default 10000: a prefill that falls
                                        further behind misses the oldest), expires events_ttl_s after the
                                        last event
    {PREFIX}:i:<instance_id>     hash   one registry record (expires with its lease, plus a grace)
    {PREFIX}:instances           zset   instance_id -> heartbeat lease deadline (listing without KEYS scans)
    {PREFIX}:left-pending        pubsub channel: transfer ids that just left PENDING (wakes long-polls)

Why one hash tag for every key, not one per transfer id: each transition script must update, in the same
atomic step, the record, the deadline index and the prefill's event stream. Redis Cluster runs a script
only over keys of one slot, so those keys must share a slot; with a per-transfer tag the index and the
stream would live elsewhere and the step would stop being atomic. The ledger's load (thousands of
transitions per second) is far below one shard's capacity. Scripts that derive a key inside Lua (the
stream of the record's prefill, the records named by the deadline index) build it from the prefixes
below, so it falls in the same slot.
"""

from __future__ import annotations

import math
import re

__all__ = ["DEFAULT_PREFIX", "Keys", "ttl_ms"]

DEFAULT_PREFIX = "pdgate"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")

# Instance keys outlive their lease by this much, so the key never vanishes before the lease check
# (done with the caller's clock) says the instance lapsed; the lease, not the TTL, decides liveness.
INSTANCE_TTL_GRACE_S = 1.0


def ttl_ms(seconds: float) -> int:
    """A TTL in whole milliseconds, never zero (PEXPIRE 0 would delete at once)."""
    return max(1, math.ceil(seconds * 1000))


class Keys:
    """Key names for one namespace."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"redis key prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        self.prefix = prefix
        tag = "{" + prefix + "}"
        self.handoff_prefix = f"{tag}:h:"
        self.events_prefix = f"{tag}:ev:"
        self.instance_prefix = f"{tag}:i:"
        self.deadlines = f"{tag}:deadlines"
        self.kv_counter = f"{tag}:kv_key"
        self.state_counts = f"{tag}:handoff-states"
        self.instances = f"{tag}:instances"
        self.left_pending = f"{tag}:left-pending"

    def handoff(self, transfer_id: str) -> str:
        return self.handoff_prefix + transfer_id

    def events(self, instance_id: str) -> str:
        return self.events_prefix + instance_id

    def instance(self, instance_id: str) -> str:
        return self.instance_prefix + instance_id

    def instance_ttl_ms(self, lease_s: float) -> int:
        return ttl_ms(lease_s + INSTANCE_TTL_GRACE_S)

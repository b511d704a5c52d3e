"""prefix_affinity: prompts that start alike go to the same instance, so its prefix cache hits.

The key is a hash of the prompt's first `prefix_chars` characters (chat: roles and texts of the
messages in order, not only the first message, which is often a shared system prompt). Instances are
ranked by rendezvous (highest-random-weight) hashing of (key, instance id): adding or removing an
instance moves only the keys it wins or held, and every router replica ranks alike (the hash is
keyed by content, not by the process). Load bound: the first instance in rank order whose load is
at most `load_factor` x (mean load + 1) wins, so a hot prefix spills to its second-ranked instance
instead of piling up. A request with no prompt text falls back to the least loaded instance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache
from random import Random
from typing import ClassVar

from pdgate.router.bodies import RequestFacts
from pdgate.router.policies import load_of
from pdgate.router.policies.least_load import LeastLoad
from pdgate.router.pool import LiveInstance

__all__ = ["PrefixAffinity", "rank"]

_MASK = (1 << 64) - 1


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@lru_cache(maxsize=4096)
def _id_hash(instance_id: str) -> int:
    return _h64(instance_id.encode())


def _mix(x: int) -> int:
    """splitmix64 finaliser: spreads (key xor id) over 64 bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


_last: tuple[bytes | None, int] = (None, 0)


def _key_hash(key: bytes) -> int:
    """`_h64(key)`, kept for the last key: one request's prefix is ranked by the decider's pick, the
    prefill's and the decode's, and the same bytes object is hashed once."""
    global _last
    last_key, k = _last
    if last_key is not key:
        k = _h64(key)
        _last = (key, k)
    return k


def _weight(k: int, instance_id: str) -> int:
    """An instance's rendezvous weight for a key hashed to `k`: the one rule `rank` and the policy share."""
    return _mix(k ^ _id_hash(instance_id))


def rank(key: bytes, ids: Sequence[str]) -> list[int]:
    """Indices of `ids` from most to least preferred for `key` (rendezvous order)."""
    k = _key_hash(key)
    weights = [_weight(k, i) for i in ids]
    return sorted(range(len(ids)), key=weights.__getitem__, reverse=True)


class PrefixAffinity:
    name: ClassVar[str] = "prefix_affinity"
    OPTIONS: ClassVar[tuple[str, ...]] = ("load_factor",)

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self.load_factor = load_factor
        self._fallback = LeastLoad()

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None:
        n = len(candidates)
        if n <= 1:
            return 0 if n else None
        if not req.prefix:
            return self._fallback.choose(candidates, req, rng)
        loads = [load_of(c) for c in candidates]
        bound = self.load_factor * (sum(loads) / n + 1.0)
        # The first instance in `rank` order under the bound, without sorting: the highest weight under the
        # bound (ties to the earlier candidate, as the stable sort), else the highest of all.
        k = _key_hash(req.prefix)
        best, best_w, top, top_w = -1, -1, 0, -1
        for i, c in enumerate(candidates):
            w = _weight(k, c.id)
            if w > top_w:
                top, top_w = i, w
            if w > best_w and loads[i] <= bound:
                best, best_w = i, w
        return best if best >= 0 else top  # the least loaded is always under the bound

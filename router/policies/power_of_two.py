"""power_of_two: two distinct instances at random, the less loaded one wins.

Why: nearly as good as least_load at spreading load, and less herd-prone when several router replicas
act on the same stale load figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import ClassVar

from pdgate.router.bodies import RequestFacts
from pdgate.router.policies import load_of
from pdgate.router.pool import LiveInstance

__all__ = ["PowerOfTwo"]


class PowerOfTwo:
    name: ClassVar[str] = "power_of_two"
    OPTIONS: ClassVar[tuple[str, ...]] = ()

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None:
        n = len(candidates)
        if n <= 1:
            return 0 if n else None
        i = int(rng.random() * n)
        j = int(rng.random() * (n - 1))
        if j >= i:
            j += 1
        return j if load_of(candidates[j]) < load_of(candidates[i]) else i

"""least_load: the instance with the smallest load (see `pdgate.router.policies.load_of`); ties by rng."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import ClassVar

from pdgate.router.bodies import RequestFacts
from pdgate.router.policies import load_of
from pdgate.router.pool import LiveInstance

__all__ = ["LeastLoad"]


class LeastLoad:
    name: ClassVar[str] = "least_load"
    OPTIONS: ClassVar[tuple[str, ...]] = ()

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None:
        n = len(candidates)
        if n <= 1:
            return 0 if n else None
        best = load_of(candidates[0])
        ties = [0]
        for i in range(1, n):
            load = load_of(candidates[i])
            if load < best:
                best = load
                ties = [i]
            elif load == best:
                ties.append(i)
        return ties[0] if len(ties) == 1 else ties[int(rng.random() * len(ties))]

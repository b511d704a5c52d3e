"""round_robin: each instance in turn; the cursor is the policy's only state."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import ClassVar

from pdgate.router.bodies import RequestFacts
from pdgate.router.pool import LiveInstance

__all__ = ["RoundRobin"]


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    OPTIONS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None:
        if not candidates:
            return None
        i = self._next % len(candidates)
        self._next = i + 1
        return i

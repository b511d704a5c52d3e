"""When an engine's answer is retried, how long to wait first, and the one loop both sides retry with.

A retry always goes to another instance (the loop excludes the ones already tried), so the delay is
short: it only spreads a burst of retries after a shared failure. Whether a failure is retried is
the error's own `retryable` (`pdgate.errors.CODES`), nothing else: a 4xx relayed from an engine or an
expired handoff is not, a failed or silent instance is. `verdict` and `backoff` are pure (`rng` is an
argument); `retry_elsewhere` is the loop the prefill and the decode attempts share.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from random import Random
from typing import TypeVar

from pdgate.router.pool import LiveInstance

from pdgate.errors import PDGateError

__all__ = ["RETRYABLE_STATUS", "Verdict", "backoff", "retry_elsewhere", "verdict"]

log = logging.getLogger("pdgate.router.proxy")

T = TypeVar("T")

# Statuses that say "this instance, now" rather than "this request": try another instance.
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class Verdict:
    OK = "ok"  # 2xx: use the answer
    REJECTED = "rejected"  # the request itself is wrong (4xx): relay to the client, do not retry
    FAILED = "failed"  # the instance failed: count it against its breaker, try another


def verdict(status: int) -> str:
    if 200 <= status < 300:
        return Verdict.OK
    if status in RETRYABLE_STATUS or status >= 500:
        return Verdict.FAILED
    if 400 <= status < 500:
        return Verdict.REJECTED
    return Verdict.FAILED  # 1xx/3xx from an engine are protocol failures


def backoff(attempt: int, base_s: float, cap_s: float, rng: Random) -> float:
    """Delay before retry number `attempt` (0-based): doubling from `base_s`, capped, half jittered."""
    delay = min(cap_s, base_s * (1 << attempt))
    return delay / 2 + rng.random() * delay / 2


async def retry_elsewhere(
    side: str,
    tries: int,
    pick: Callable[[Sequence[str]], Awaitable[LiveInstance | None]],
    attempt: Callable[[LiveInstance], Awaitable[T]],
    none_left: Callable[[], PDGateError],
    pause: Callable[[int], Awaitable[None]],
) -> T:
    """Run `attempt` on one instance after another until one succeeds, or fails in a way that is not
    `retryable`, or `tries` attempts were made; then the last failure is raised.

    `pick` chooses an instance outside the ids tried so far and prepares it (the prefill side creates
    that attempt's handoff there: a failure to do so is raised as it is, never retried); None means no
    eligible instance is left, and `none_left()` is raised unless an attempt already failed.
    `pause(n)` is awaited after failed attempt n (0-based) when another may follow.
    """
    tried: list[str] = []
    last: PDGateError | None = None
    for n in range(tries):
        if n:
            await pause(n - 1)
        inst = await pick(tried)
        if inst is None:
            raise last if last is not None else none_left()
        tried.append(inst.id)
        try:
            return await attempt(inst)
        except PDGateError as exc:
            if not exc.retryable:
                raise
            last = exc
            found = exc.context.get("detail")  # `errors.detail`: the log reads the engine's words too
            log.warning("%s %s failed (attempt %d/%d): %s", side, inst.id, n + 1, tries, found or exc.message)
    assert last is not None
    raise last

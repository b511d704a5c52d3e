"""When to retry an engine's answer, and how long to wait first (pure; `rng` is an argument).

A retry always goes to another instance (the proxy excludes the ones already tried), so the delay is
short: it only spreads a burst of retries after a shared failure.
"""

from __future__ import annotations

from random import Random

__all__ = ["RETRYABLE_STATUS", "Verdict", "backoff", "verdict"]

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
    delay = min(cap_s, base_s * (2**attempt))
    return delay / 2 + rng.random() * delay / 2

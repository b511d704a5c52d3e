"""retry.py: which answers are retried elsewhere, the backoff bounds, and the one retry loop (driven by
each error's `retryable`)."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import Any

import pytest
from pdgate.router.errors import DecodeFailed, KVExpired, NoCompatiblePair, PrefillFailed, UpstreamTimeout
from pdgate.router.retry import Verdict, backoff, retry_elsewhere, verdict


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Verdict.OK),
        (204, Verdict.OK),
        (400, Verdict.REJECTED),
        (404, Verdict.REJECTED),
        (422, Verdict.REJECTED),
        (408, Verdict.FAILED),
        (429, Verdict.FAILED),
        (500, Verdict.FAILED),
        (503, Verdict.FAILED),
        (507, Verdict.FAILED),
        (302, Verdict.FAILED),
    ],
)
def test_verdict(status: int, expected: str) -> None:
    assert verdict(status) == expected


def test_backoff_doubles_is_capped_and_half_jittered() -> None:
    rng = Random(7)
    for attempt in range(10):
        delay = backoff(attempt, 0.01, 0.5, rng)
        full = min(0.5, 0.01 * 2**attempt)
        assert full / 2 <= delay <= full


class Inst:
    def __init__(self, id: str) -> None:
        self.id = id


def loop_parts(ids: list[str], outcomes: dict[str, Exception | str]) -> tuple[Any, Any, list[str], list[int]]:
    """A `pick` over `ids` (skipping tried ones) and an `attempt` that raises or returns per instance."""
    tried_log: list[str] = []
    pauses: list[int] = []

    async def pick(tried: Sequence[str]) -> Any:
        left = [i for i in ids if i not in tried]
        return Inst(left[0]) if left else None

    async def attempt(inst: Any) -> str:
        tried_log.append(inst.id)
        out = outcomes[inst.id]
        if isinstance(out, Exception):
            raise out
        return out

    return pick, attempt, tried_log, pauses


async def test_retryable_failures_move_to_the_next_instance() -> None:
    pick, attempt, tried, pauses = loop_parts(
        ["a", "b", "c"], {"a": DecodeFailed("x"), "b": UpstreamTimeout("y"), "c": "ok"}
    )

    async def pause(n: int) -> None:
        pauses.append(n)

    assert await retry_elsewhere("decode", 3, pick, attempt, lambda: NoCompatiblePair("none"), pause) == "ok"
    assert tried == ["a", "b", "c"] and pauses == [0, 1]


async def test_a_failure_that_is_not_retryable_ends_the_loop_at_once() -> None:
    pick, attempt, tried, _ = loop_parts(["a", "b"], {"a": KVExpired("gone"), "b": "ok"})
    with pytest.raises(KVExpired):
        await retry_elsewhere("decode", 3, pick, attempt, lambda: NoCompatiblePair("none"), _no_pause)
    assert tried == ["a"]


async def test_when_no_instance_is_left_the_last_failure_is_raised() -> None:
    pick, attempt, _, _ = loop_parts(["a"], {"a": PrefillFailed("bad")})
    with pytest.raises(PrefillFailed, match="bad"):
        await retry_elsewhere("prefill", 3, pick, attempt, lambda: NoCompatiblePair("none"), _no_pause)
    pick, attempt, _, _ = loop_parts([], {})
    with pytest.raises(NoCompatiblePair, match="none"):
        await retry_elsewhere("prefill", 3, pick, attempt, lambda: NoCompatiblePair("none"), _no_pause)


async def test_tries_bound_the_attempts() -> None:
    pick, attempt, tried, _ = loop_parts(["a", "b", "c"], {i: DecodeFailed(i) for i in "abc"})
    with pytest.raises(DecodeFailed, match="b"):
        await retry_elsewhere("decode", 2, pick, attempt, lambda: NoCompatiblePair("none"), _no_pause)
    assert tried == ["a", "b"]


async def _no_pause(n: int) -> None:
    return None

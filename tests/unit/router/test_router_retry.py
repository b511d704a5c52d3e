"""retry.py: which answers are retried elsewhere, and the backoff bounds."""

from __future__ import annotations

from random import Random

import pytest
from pdgate.router.retry import Verdict, backoff, verdict


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

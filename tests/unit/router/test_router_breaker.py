"""breaker.py: the circuit breaker's states over an injected clock (no sleeping)."""

from __future__ import annotations

from pdgate.router.breaker import BreakerConfig, BreakerState, CircuitBreaker


def make(**kw: float) -> tuple[CircuitBreaker, list[tuple[BreakerState, BreakerState]]]:
    moves: list[tuple[BreakerState, BreakerState]] = []
    cfg = BreakerConfig(**{"failures": 3, "open_s": 10.0, "successes": 1, **kw})  # type: ignore[arg-type]
    return CircuitBreaker(cfg, lambda a, b: moves.append((a, b))), moves


def test_opens_after_consecutive_failures_only() -> None:
    b, moves = make()
    b.record_failure(0)
    b.record_failure(0)
    b.record_success(0)  # resets the count
    b.record_failure(0)
    b.record_failure(0)
    assert b.can_pass(0)
    b.record_failure(0)
    assert b.state(0) is BreakerState.OPEN and not b.can_pass(5)
    assert moves == [(BreakerState.CLOSED, BreakerState.OPEN)]


def test_half_open_lets_one_probe_and_a_success_closes() -> None:
    b, moves = make()
    for _ in range(3):
        b.record_failure(0)
    assert not b.can_pass(9.99)
    assert b.can_pass(10.0) and b.state(10.0) is BreakerState.HALF_OPEN
    b.on_dispatch(10.0)
    assert not b.can_pass(10.5)  # the probe is in flight
    b.record_success(11.0)
    assert b.state(11.0) is BreakerState.CLOSED and b.can_pass(11.0)
    assert moves[-2:] == [(BreakerState.OPEN, BreakerState.HALF_OPEN), (BreakerState.HALF_OPEN, BreakerState.CLOSED)]


def test_a_failed_probe_opens_again_for_a_full_period() -> None:
    b, _ = make()
    for _ in range(3):
        b.record_failure(0)
    b.on_dispatch(10)
    b.record_failure(12)
    assert b.state(12) is BreakerState.OPEN
    assert not b.can_pass(21.9)
    assert b.can_pass(22)


def test_several_successes_needed_when_configured() -> None:
    b, _ = make(successes=2)
    for _ in range(3):
        b.record_failure(0)
    b.on_dispatch(10)
    b.record_success(10)
    assert b.state(10) is BreakerState.HALF_OPEN and b.can_pass(10)
    b.on_dispatch(10)
    b.record_success(10)
    assert b.state(10) is BreakerState.CLOSED


def test_gauge_values() -> None:
    assert [s.gauge for s in (BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN)] == [0, 1, 2]

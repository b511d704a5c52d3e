"""breaker.py's burst rule: failures of requests in flight together count once; a dead engine still opens.

Why (issue #21, finding 3): one client's fan-out put hundreds of prompts in flight on one prefill, their
connect timeouts came from the router's own queueing, and each counted against the engine: the breaker
opened and every other client was told "unavailable". The rule must not blind the breaker either: an
engine that fails every request, one at a time or many at once, still opens it. Pure, on an injected
clock, as `test_router_breaker.py`."""

from __future__ import annotations

from pdgate.router.breaker import BreakerConfig, BreakerState, CircuitBreaker

FAILURES = 5


def make() -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(failures=FAILURES, open_s=10.0, successes=1))


def test_a_burst_of_256_in_flight_together_failing_together_counts_once() -> None:
    b = make()
    burst = [b.on_dispatch(0.0) for _ in range(256)]
    for n in burst:
        b.record_failure(1.0, n)
    assert b.state(1.0) is BreakerState.CLOSED and b.can_pass(1.0)
    # ...and it was one failure, not none: four more, one at a time, open it (5 in all).
    for _ in range(FAILURES - 1):
        b.record_failure(2.0, b.on_dispatch(2.0))
    assert b.state(2.0) is BreakerState.OPEN


def test_a_dead_engine_opens_the_breaker_one_request_at_a_time() -> None:
    b = make()
    for i in range(FAILURES):
        assert b.can_pass(float(i))
        b.record_failure(float(i), b.on_dispatch(float(i)))
    assert b.state(FAILURES) is BreakerState.OPEN and not b.can_pass(FAILURES)


def test_a_dead_engine_under_concurrent_load_still_opens_the_breaker() -> None:
    """Waves of 32 in flight at once: each wave counts once, so the fifth wave after the first opens it."""
    b = make()
    waves = 0
    while b.state(float(waves)) is BreakerState.CLOSED:
        assert waves < FAILURES, "a dead engine never opened its breaker"
        wave = [b.on_dispatch(float(waves)) for _ in range(32)]
        for n in wave:
            b.record_failure(float(waves), n)
        waves += 1
    assert waves == FAILURES


def test_requests_sent_after_a_counted_failure_count_though_older_ones_are_still_failing() -> None:
    """Overlapping requests: a request dispatched after the last counted failure is a new signal even if
    requests from the old burst are still coming back failed (those stay one)."""
    b = make()
    old = [b.on_dispatch(0.0) for _ in range(8)]
    b.record_failure(0.1, old[0])  # counts (1); the rest of `old` is its burst
    new = b.on_dispatch(0.2)  # sent after that failure: the engine was given another chance
    b.record_failure(0.3, old[1])  # the old burst: not counted
    b.record_failure(0.4, new)  # counts (2)
    for n in old[2:]:
        b.record_failure(0.5, n)  # in flight when `new` failed: still that burst
    for _ in range(FAILURES - 3):
        b.record_failure(0.6, b.on_dispatch(0.6))  # 3, 4
    assert b.state(0.6) is BreakerState.CLOSED
    b.record_failure(0.7, b.on_dispatch(0.7))  # 5
    assert b.state(0.7) is BreakerState.OPEN


def test_a_failure_without_a_dispatch_number_always_counts() -> None:
    b = make()
    for n in [b.on_dispatch(0.0) for _ in range(3)]:
        b.record_failure(0.0, n)  # one burst: 1
    for _ in range(FAILURES - 1):
        b.record_failure(0.0)  # unnumbered (e.g. a health check): each counts
    assert b.state(0.0) is BreakerState.OPEN


def test_a_success_between_bursts_resets_the_count() -> None:
    b = make()
    for _ in range(FAILURES - 1):
        b.record_failure(0.0, b.on_dispatch(0.0))
    b.record_success(0.0)
    for _ in range(FAILURES - 1):
        b.record_failure(0.0, b.on_dispatch(0.0))
    assert b.state(0.0) is BreakerState.CLOSED


def test_the_burst_rule_does_not_apply_to_a_half_open_probe() -> None:
    """Half-open, the probe decides alone: its failure reopens, however old the burst it is compared with."""
    b = make()
    for _ in range(FAILURES):
        b.record_failure(0.0, b.on_dispatch(0.0))
    assert b.state(10.0) is BreakerState.HALF_OPEN
    probe = b.on_dispatch(10.0)
    b.record_failure(10.5, probe)
    assert b.state(10.5) is BreakerState.OPEN and not b.can_pass(15.0)

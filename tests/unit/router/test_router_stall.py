"""The first-byte timeout a streamed decode gets (router/stall.py): the configured one until the router has
seen enough first bytes, then max(floor, factor x their p99), never above the configured one."""

from __future__ import annotations

from pdgate.router.stall import MIN_SAMPLES, FirstByteClock


def test_the_configured_timeout_holds_until_enough_first_bytes_were_seen() -> None:
    clock = FirstByteClock(ceiling_s=30.0, floor_s=0.5, factor=4.0)
    for _ in range(MIN_SAMPLES - 1):
        clock.observe(0.01)
    assert clock.timeout() == 30.0
    clock.observe(0.01)
    assert clock.timeout() == 0.5  # 4 x 0.01 is under the floor


def test_the_timeout_follows_the_p99_and_stays_under_the_ceiling() -> None:
    clock = FirstByteClock(ceiling_s=30.0, floor_s=0.5, factor=4.0)
    for i in range(100):
        clock.observe(2.0 if i == 99 else 1.0)  # one slow first byte in 100 is the p99's edge
    assert clock.timeout() == 4.0
    for _ in range(512):
        clock.observe(10.0)
    assert clock.timeout() == 30.0


def test_factor_0_is_the_configured_timeout_alone() -> None:
    clock = FirstByteClock(ceiling_s=30.0, floor_s=0.5, factor=0.0)
    for _ in range(100):
        clock.observe(0.01)
    assert clock.timeout() == 30.0

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


def test_a_request_queued_behind_others_on_one_decode_gets_more_time() -> None:
    """A burst on one decode is late, not stalled: each request waits the bound times (1 + the requests
    sent to that decode before it still waiting), capped by the ceiling; other decodes are not affected."""
    clock = FirstByteClock(ceiling_s=30.0, floor_s=0.5, factor=4.0)
    for _ in range(MIN_SAMPLES):
        clock.observe(0.25)  # bound: 4 x 0.25 = 1.0 s
    assert [clock.enter("d0") for _ in range(3)] == [1.0, 2.0, 3.0]
    assert clock.enter("d1") == 1.0  # a stopped decode is still left at the bound by its first request
    clock.leave("d0")
    clock.leave("d0")
    assert clock.enter("d0") == 2.0  # one still ahead
    for _ in range(40):
        clock.enter("d0")
    assert clock.enter("d0") == 30.0
    for _ in range(45):
        clock.leave("d0")
    clock.leave("d0")  # more leaves than enters never goes below nobody
    assert clock.enter("d0") == 1.0

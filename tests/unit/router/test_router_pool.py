"""pool.py: eligibility, compatible candidates, accounting (leases) that survives refreshes."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest
from pdgate.router.breaker import BreakerConfig, BreakerState
from pdgate.router.pairing import InstanceView
from pdgate.router.policies import load_of
from pdgate.router.pool import Pool

from pdgate.models import Role
from pdgate.urls import static_instance_id

P1 = InstanceView(id="p1", role=Role.PREFILL, url="http://p1", model="m", block_size=16)
P2 = replace(P1, id="p2", url="http://p2")
D1 = InstanceView(id="d1", role=Role.DECODE, url="http://d1", model="m", block_size=16)
D32 = replace(D1, id="d32", url="http://d32", block_size=32)


def ids(instances: list) -> list[str]:
    return [i.id for i in instances]


def test_prefills_need_an_available_compatible_decode() -> None:
    pool = Pool()
    pool.replace([P1, replace(P2, block_size=32), D1])
    assert ids(pool.prefill_candidates("m", 0)) == ["p1"]  # p2 (block 32) has no decode
    assert ids(pool.decode_candidates(pool.instances["p1"], 0)) == ["d1"]
    assert pool.models(0) == ["m"]
    pool.set_health("http://d1", False, "connection refused")
    assert pool.prefill_candidates("m", 0) == [] and pool.models(0) == []
    assert "d1 failed its health check (connection refused)" in pool.explain("m", 0)


def test_draining_unknown_model_and_open_breaker_are_skipped() -> None:
    events: list[tuple[str, BreakerState]] = []
    pool = Pool(BreakerConfig(failures=1, open_s=5), on_breaker=lambda i, s: events.append((i, s)))
    pool.replace(
        [P1, replace(P2, draining=True), D1, InstanceView(id="s", role=Role.PREFILL, url="http://s", model=None)]
    )
    assert ids(pool.prefill_candidates("m", 0)) == ["p1"]
    inst = pool.instances["p1"]
    with pool.lease(inst, 10, lambda: 0) as lease:
        lease.failed()
    assert pool.prefill_candidates("m", 1) == [] and events == [("p1", BreakerState.OPEN)]
    assert "p1 has its circuit breaker open" in pool.explain("m", 1)
    assert ids(pool.prefill_candidates("m", 5)) == ["p1"]  # half-open: one probe may pass
    with pool.lease(inst, 10, lambda: 5) as lease:
        assert pool.prefill_candidates("m", 5) == []  # the probe is out
        lease.succeeded()
    assert ids(pool.prefill_candidates("m", 6)) == ["p1"]


def test_exclusions_and_both_role() -> None:
    both = InstanceView(id="b", role=Role.BOTH, url="http://b", model="m")
    pool = Pool()
    pool.replace([P1, P2, both, D1])
    assert ids(pool.prefill_candidates("m", 0, exclude=["p1"])) == ["b", "p2"]
    assert ids(pool.decode_candidates(pool.instances["p1"], 0, exclude=["d1"])) == ["b"]


def test_live_instances_keep_counts_across_refreshes_and_drop_vanished_ids() -> None:
    seen: list[tuple[str, int]] = []
    pool = Pool(on_inflight=lambda t: seen.append((t.id, t.requests)))
    pool.replace([P1, D1])
    inst = pool.instances["p1"]
    with pool.lease(inst, 100, lambda: 0):
        pool.replace([replace(P1, reported=7), D1])
        assert pool.instances["p1"] is inst and inst.requests == 1 and inst.tokens == 100 and inst.others == 6
        pool.replace([D1])
        assert "p1" not in pool.instances and seen[-1] == ("p1", 0)
    assert inst.requests == 0 and inst.tokens == 0  # a lease ending after its instance left never goes negative


def test_a_report_counts_only_what_others_had_in_flight_and_the_routers_own_count_is_live() -> None:
    """An engine reports running+waiting with each heartbeat, and the router reads it a poll later: the
    figure includes this router's own requests as they were then. After they finish, the stale report
    must not keep the engine loaded (the old load, max(own, reported), stayed at the report until the
    next heartbeat); a request from another router replica in the report still counts."""
    pool = Pool()
    pool.replace([P1, D1])
    inst = pool.instances["d1"]
    with ExitStack() as ours:
        for _ in range(3):
            ours.enter_context(pool.lease(inst, 0, lambda: 0))
        pool.replace([P1, replace(D1, reported=4, reported_at=10.0)])  # our 3 and one of another replica's
        assert inst.others == 1 and load_of(inst) == 4
    assert inst.others == 1 and load_of(inst) == 1  # the report is stale; our own count is not
    pool.replace([P1, replace(D1, reported=4, reported_at=10.0)])  # the same report, read again
    assert load_of(inst) == 1
    pool.replace([P1, replace(D1, reported=1, reported_at=11.0)])  # the next heartbeat
    # Taken while our 3 may still have been on the engine: the 1 could be ours, so it counts as nobody's.
    assert inst.others == 0 and load_of(inst) == 0
    pool.replace([P1, replace(D1, reported=1, reported_at=12.0)])  # taken with nothing of ours in flight
    assert inst.others == 1 and load_of(inst) == 1
    with pool.lease(inst, 0, lambda: 0):
        assert load_of(inst) == 2
        pool.replace([P1, replace(D1, reported=0, reported_at=13.0)])  # ours not there yet: never negative
        assert inst.others == 0 and load_of(inst) == 1


def test_a_report_read_after_our_requests_ended_does_not_count_them_as_someone_elses() -> None:
    """The engine takes its report at a heartbeat; the router reads it up to a registry poll later. A turn
    of a conversation in flight at the heartbeat and finished before the read is in the report and no
    longer in this router's count: the report less the count at the read would make it somebody else's
    (load 1 on an idle engine until the next heartbeat). The most this router had in flight since the
    previous report's arrival bounds what it had at the heartbeat."""
    pool = Pool()
    pool.replace([P1, replace(D1, reported=0, reported_at=1.0)])
    inst = pool.instances["d1"]
    with ExitStack() as turn:
        for _ in range(4):
            turn.enter_context(pool.lease(inst, 0, lambda: 0))
    with pool.lease(inst, 0, lambda: 0):  # the next request, in flight when the report is read
        pool.replace([P1, replace(D1, reported=4, reported_at=2.0)])  # taken while the 4 ran
        assert inst.others == 0 and load_of(inst) == 1
    # Another router's 2 requests beside ours: seen once our own swing no longer covers them.
    pool.replace([P1, replace(D1, reported=2, reported_at=3.0)])  # taken while ours (1, at most) ran too
    assert inst.others == 1
    pool.replace([P1, replace(D1, reported=2, reported_at=4.0)])  # nothing of ours since the last read
    assert inst.others == 2 and load_of(inst) == 2


def test_a_lease_ends_its_count_however_the_request_ends() -> None:
    pool = Pool(BreakerConfig(failures=1, open_s=5))
    pool.replace([P1, D1])
    inst = pool.instances["p1"]
    with pytest.raises(RuntimeError), pool.lease(inst, 7, lambda: 0):
        assert (inst.requests, inst.tokens) == (1, 7)
        raise RuntimeError("boom")  # no verdict: the breaker is left alone
    assert (inst.requests, inst.tokens) == (0, 0) and ids(pool.prefill_candidates("m", 0)) == ["p1"]


def test_incompatible_decode_never_offered() -> None:
    pool = Pool()
    pool.replace([P1, D32])
    assert pool.decode_candidates(pool.instances["p1"], 0) == []
    assert "d32 has block_size 32, p1 has 16" in pool.explain("m", 0)


def test_counts_by_role_and_availability() -> None:
    pool = Pool()
    pool.replace([P1, D1])
    pool.set_health("http://p1", False)
    counts = pool.counts(0)
    assert counts[("prefill", "unavailable")] == 1 and counts[("decode", "available")] == 1
    assert counts[("both", "available")] == 0


def test_static_instance_id_is_a_valid_metaserver_id() -> None:
    from pdgate.models import is_valid_id

    for url in ("http://127.0.0.1:8100", "https://[::1]:9000", "http://engine-a.local", "http://x_y:1"):
        assert is_valid_id(static_instance_id(url)), url
    assert static_instance_id("http://127.0.0.1:8100") == "127.0.0.1-8100"


def test_a_prefill_that_left_the_snapshot_mid_request_still_pairs() -> None:
    pool = Pool()
    pool.replace([P1, D1, D32])
    p1 = pool.instances["p1"]
    pool.replace([D1, D32])  # p1's lease lapsed while its request was in flight
    assert ids(pool.decode_candidates(p1, 0)) == ["d1"]

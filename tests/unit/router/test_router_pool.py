"""pool.py: eligibility, compatible candidates, accounting that survives refreshes."""

from __future__ import annotations

from dataclasses import replace

from pdgate.metaserver.models import Role
from pdgate.router.breaker import BreakerConfig, BreakerState
from pdgate.router.pool import InstanceView, Pool, static_instance_id

P1 = InstanceView(id="p1", role=Role.PREFILL, url="http://p1", model="m", block_size=16)
P2 = replace(P1, id="p2", url="http://p2")
D1 = InstanceView(id="d1", role=Role.DECODE, url="http://d1", model="m", block_size=16)
D32 = replace(D1, id="d32", url="http://d32", block_size=32)


def ids(trackers: list) -> list[str]:
    return [t.id for t in trackers]


def test_prefills_need_an_available_compatible_decode() -> None:
    pool = Pool()
    pool.replace([P1, replace(P2, block_size=32), D1])
    assert ids(pool.prefill_candidates("m", 0)) == ["p1"]  # p2 (block 32) has no decode
    assert ids(pool.decode_candidates(pool.trackers["p1"], 0)) == ["d1"]
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
    tr = pool.trackers["p1"]
    pool.record(tr, False, 0)
    assert pool.prefill_candidates("m", 1) == [] and events == [("p1", BreakerState.OPEN)]
    assert "p1 has its circuit breaker open" in pool.explain("m", 1)
    assert ids(pool.prefill_candidates("m", 5)) == ["p1"]  # half-open: one probe may pass
    pool.begin(tr, 10, 5)
    assert pool.prefill_candidates("m", 5) == []
    pool.end(tr, 10)
    pool.record(tr, True, 6)
    assert ids(pool.prefill_candidates("m", 6)) == ["p1"]


def test_exclusions_and_both_role() -> None:
    both = InstanceView(id="b", role=Role.BOTH, url="http://b", model="m")
    pool = Pool()
    pool.replace([P1, P2, both, D1])
    assert ids(pool.prefill_candidates("m", 0, exclude=["p1"])) == ["b", "p2"]
    assert ids(pool.decode_candidates(pool.trackers["p1"], 0, exclude=["d1"])) == ["b"]


def test_trackers_keep_counts_across_refreshes_and_drop_vanished_ids() -> None:
    seen: list[tuple[str, int]] = []
    pool = Pool(on_inflight=lambda t: seen.append((t.id, t.requests)))
    pool.replace([P1, D1])
    tr = pool.trackers["p1"]
    pool.begin(tr, 100, 0)
    pool.replace([replace(P1, reported=7), D1])
    assert pool.trackers["p1"] is tr and tr.requests == 1 and tr.tokens == 100 and tr.reported == 7
    pool.replace([D1])
    assert "p1" not in pool.trackers and seen[-1] == ("p1", 0)


def test_incompatible_decode_never_offered() -> None:
    pool = Pool()
    pool.replace([P1, D32])
    assert pool.decode_candidates(pool.trackers["p1"], 0) == []
    assert "d32 has block_size 32, p1 has 16" in pool.explain("m", 0)


def test_counts_by_role_and_availability() -> None:
    pool = Pool()
    pool.replace([P1, D1])
    pool.set_health("http://p1", False)
    counts = pool.counts(0)
    assert counts[("prefill", "unavailable")] == 1 and counts[("decode", "available")] == 1
    assert counts[("both", "available")] == 0


def test_static_instance_id_is_a_valid_metaserver_id() -> None:
    from pdgate.metaserver.models import is_valid_id

    for url in ("http://127.0.0.1:8100", "https://[::1]:9000", "http://engine-a.local", "http://x_y:1"):
        assert is_valid_id(static_instance_id(url)), url
    assert static_instance_id("http://127.0.0.1:8100") == "127.0.0.1-8100"


def test_a_prefill_that_left_the_snapshot_mid_request_still_pairs() -> None:
    pool = Pool()
    pool.replace([P1, D1, D32])
    p1 = pool.trackers["p1"]
    pool.replace([D1, D32])  # p1's lease lapsed while its request was in flight
    assert ids(pool.decode_candidates(p1, 0)) == ["d1"]

"""The transport conformance suite (issue #23): the same cases for every transport (``harness`` fixture).

What each case would catch:
* scattered reads: a transport that copies the wrong block, drops one, writes outside the request, or
  mishandles merged runs next to scattered blocks (both sides use different layouts);
* a peer that dies mid-read or before the read: a hang, a success reported on missing bytes, an untyped error;
* a stalled peer: a pull that never ends, or one failed before its deadline;
* deregistered memory: a transport that reads memory its owner no longer serves;
* a second registration: a transport that silently replaces (or breaks) its first registration;
* descriptors for another engine: a foreign address accepted, or another engine's addresses read through
  this one's session;
* many decodes at once: crosstalk between concurrent pullers of one prefill;
* close during a pull: a close that crashes or hangs, or a transport usable after close.
A transport that fails a case is a bug, never a skip (``conftest.py`` skips only a package not installed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
from pdgate.connector.transport.base import PullRequest, PullResult, Transport
from pdgate.connector.transport.errors import (
    InvalidPull,
    PullTimeout,
    RegistrationError,
    TransportClosed,
    TransportError,
)

from tests.transport_conformance.harness import Decode, Harness, Peer
from tests.transport_conformance.layout import BLOCK_LEN, NUM_BLOCKS, REGION_NAMES, decode_buffers, decode_regions

KINDS = ("nixl", "mooncake", "llmdatadist")


def wait_for(transport: Transport, tid: str, bound_s: float = 15.0) -> tuple[PullResult, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        for res in transport.poll():
            assert res.transfer_id == tid
            return res, time.monotonic() - t0
        time.sleep(0.001)
    raise AssertionError(f"no result for {tid} within {bound_s}s")


def assert_pulled(peer: Peer, d: Decode, src: Sequence[int], dst: Sequence[int], *, only: bool = True) -> None:
    for r in range(len(REGION_NAMES)):
        for s, t in zip(src, dst, strict=True):
            np.testing.assert_array_equal(d.block(r, int(t)), peer.block(r, int(s)), err_msg=f"region {r} {s}->{t}")
        if only:
            untouched = np.setdiff1d(np.arange(NUM_BLOCKS), np.asarray(dst))
            outside = d.bufs[r].reshape(NUM_BLOCKS, BLOCK_LEN)[untouched]
            assert not outside.any(), "a block outside the request was written"


def scattered(seed: int, n: int) -> tuple[list[int], list[int]]:
    """A run of 24 blocks adjacent on both sides (merged into one range) plus ``n`` scattered pairs."""
    rng = np.random.default_rng(seed)
    src = list(range(10, 34))
    dst = list(range(100, 124))
    free_src = [b for b in rng.permutation(NUM_BLOCKS).tolist() if b not in src]
    free_dst = [b for b in rng.permutation(NUM_BLOCKS).tolist() if b not in dst]
    return src + free_src[:n], dst + free_dst[:n]


def test_scattered_reads_are_byte_exact(harness: Harness) -> None:
    peer = harness.peer(seed=11)
    d = harness.decode()
    src, dst = scattered(5, 120)
    d.t.start_pull(PullRequest("scatter-1", 7, peer.address, src, dst))
    res, _ = wait_for(d.t, "scatter-1")
    assert res.ok, res.error
    assert res.nbytes == len(src) * BLOCK_LEN * len(REGION_NAMES)
    assert_pulled(peer, d, src, dst)
    # A second pull from the same peer (its link or session is reused) lands next to the first.
    src2 = [200, 3, 4, 5]
    dst2 = [b for b in range(NUM_BLOCKS) if b not in dst][:4]
    d.t.start_pull(PullRequest("scatter-2", 8, peer.address, src2, dst2))
    assert wait_for(d.t, "scatter-2")[0].ok
    assert_pulled(peer, d, src + src2, dst + dst2)


def test_a_dead_peer_fails_the_pull_with_a_typed_error(harness: Harness) -> None:
    peer = harness.peer(seed=12)
    d = harness.decode()
    d.t.start_pull(PullRequest("warm", 1, peer.address, [1, 2, 3], [4, 5, 6]))
    assert wait_for(d.t, "warm")[0].ok
    peer.kill()
    for tid in ("after-kill", "again"):  # the second one goes through whatever reconnect path there is
        d.t.start_pull(PullRequest(tid, 2, peer.address, [7, 8], [9, 10]))
        res, _ = wait_for(d.t, tid)
        assert not res.ok and isinstance(res.error, harness.dead_errors), res.error


def test_a_peer_that_dies_mid_read_ends_the_pull_before_its_deadline(harness: Harness) -> None:
    peer = harness.peer(seed=13)
    d = harness.decode()
    d.t.start_pull(PullRequest("warm", 1, peer.address, [1], [1]))  # first contact made while it is alive
    assert wait_for(d.t, "warm")[0].ok
    peer.stall()
    d.t.start_pull(PullRequest("mid", 6, peer.address, list(range(64)), list(range(64))))
    time.sleep(0.3)
    assert d.t.poll() == []  # held open by the stopped peer, as intended
    peer.kill()
    res, _ = wait_for(d.t, "mid")
    # The death is detected, not waited out: never the stall deadline's PullTimeout.
    assert not res.ok and isinstance(res.error, harness.dead_errors), res.error


def test_a_stalled_peer_times_out_and_a_fresh_peer_then_works(harness: Harness) -> None:
    stalled = harness.peer(seed=14)
    d = harness.decode(stall_deadline=True)
    d.t.start_pull(PullRequest("warm", 1, stalled.address, [1], [1]))
    assert wait_for(d.t, "warm")[0].ok
    stalled.stall()
    d.t.start_pull(PullRequest("stall", 4, stalled.address, list(range(64)), list(range(64))))
    res, took = wait_for(d.t, "stall")
    assert not res.ok and isinstance(res.error, PullTimeout), res.error
    assert took >= harness.stall_floor_s  # the deadline, not before it
    stalled.resume()

    fresh = harness.peer(seed=15)
    src, dst = [3, 1, 2], [200, 150, 175]
    d.t.start_pull(PullRequest("fresh", 5, fresh.address, src, dst))
    res2, _ = wait_for(d.t, "fresh")
    assert res2.ok, res2.error
    assert_pulled(fresh, d, src, dst, only=False)


def test_deregistered_memory_is_not_read(harness: Harness) -> None:
    # The peer's transport closes (its memory is deregistered) while its process, and the bytes, live on.
    peer = harness.peer(seed=16)
    d = harness.decode()
    d.t.start_pull(PullRequest("warm", 1, peer.address, [1], [1]))
    assert wait_for(d.t, "warm")[0].ok
    peer.deregister()
    d.t.start_pull(PullRequest("gone", 2, peer.address, [5, 6, 7], [20, 21, 22]))
    res, _ = wait_for(d.t, "gone")
    assert not res.ok and isinstance(res.error, harness.deregistered_errors), res.error
    assert not any(d.block(r, b).any() for r in range(len(REGION_NAMES)) for b in (20, 21, 22))


def test_a_second_registration_is_refused_and_the_first_keeps_working(harness: Harness) -> None:
    peer = harness.peer(seed=17)
    d = harness.decode()
    other = decode_buffers()
    with pytest.raises(RegistrationError, match="already"):
        d.t.register(decode_regions(other))
    d.t.start_pull(PullRequest("after", 1, peer.address, [9, 10], [30, 31]))
    assert wait_for(d.t, "after")[0].ok
    assert_pulled(peer, d, [9, 10], [30, 31])
    assert not any(b.any() for b in other)  # the refused registration received nothing


def test_descriptors_for_another_engine_are_refused(harness: Harness) -> None:
    a = harness.peer(seed=18)
    b = harness.peer(seed=19)
    d = harness.decode()
    for kind in KINDS:
        if kind != harness.kind:  # a peer of another transport: refused before anything moves
            with pytest.raises(InvalidPull, match="kind"):
                d.t.start_pull(PullRequest("foreign", 1, {**a.address, "kind": kind}, [0], [0]))
    # A's identity (session, agent, cluster) with B's buffer descriptors: never B's bytes through A.
    mixed = {**b.address, **{k: v for k, v in a.address.items() if k not in ("regions", "buffers")}}
    try:
        d.t.start_pull(PullRequest("mixed", 2, mixed, [40, 41], [40, 41]))
    except InvalidPull:
        pass  # refused up front: fine
    else:
        res, _ = wait_for(d.t, "mixed")
        if harness.addresses_by_key:  # the engine ignores addresses: A's own blocks, exactly
            assert res.ok, res.error
            assert_pulled(a, d, [40, 41], [40, 41])
        else:
            assert not res.ok and isinstance(res.error, TransportError), res
    assert d.t.poll() == []
    d.t.start_pull(PullRequest("good", 3, a.address, [0], [0]))  # the transport is still usable
    assert wait_for(d.t, "good")[0].ok
    assert_pulled(a, d, [0], [0], only=False)


def test_many_decodes_pull_from_one_peer_at_once(harness: Harness) -> None:
    peer = harness.peer(seed=20)
    decodes = [harness.decode() for _ in range(4)]
    plans = [scattered(30 + i, 40) for i in range(len(decodes))]
    for i, (d, (src, dst)) in enumerate(zip(decodes, plans, strict=True)):
        d.t.start_pull(PullRequest(f"many-{i}", i, peer.address, src, dst))
    results: dict[int, PullResult] = {}
    deadline = time.monotonic() + 30.0
    while len(results) < len(decodes) and time.monotonic() < deadline:
        for i, d in enumerate(decodes):
            for res in d.t.poll():
                results[i] = res
        time.sleep(0.001)
    assert sorted(results) == list(range(len(decodes)))
    for i, d in enumerate(decodes):
        assert results[i].ok and results[i].transfer_id == f"many-{i}", results[i].error
        assert_pulled(peer, d, *plans[i])


def test_close_during_a_pull_returns_and_leaves_the_transport_closed(harness: Harness) -> None:
    peer = harness.peer(seed=21)
    d = harness.decode(stall_deadline=True)
    d.t.start_pull(PullRequest("warm", 1, peer.address, [1], [1]))
    assert wait_for(d.t, "warm")[0].ok
    peer.stall()
    d.t.start_pull(PullRequest("cut", 2, peer.address, list(range(64)), list(range(64))))
    time.sleep(0.2)
    d.t.close()  # returns: in-flight pulls are abandoned, not reported
    assert d.t.poll() == []
    with pytest.raises(TransportClosed):
        d.t.start_pull(PullRequest("late", 3, peer.address, [0], [0]))
    d.t.close()  # idempotent
    peer.resume()

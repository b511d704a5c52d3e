"""NixlTransport between two real processes over UCX on loopback.

The prefill side is ``nixl_peer.py`` in a subprocess; the decode side lives in the test
process. nixl must be importable here: a missing nixl is a failed test, not a skip.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pdgate.connector.transfer_thread import _IDLE_POLL_S
from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult
from pdgate.connector.transport.errors import InvalidPull, PeerUnreachable, PullTimeout
from pdgate.connector.transport.nixl import NixlTransport

from tests.integration.nixl_peer import PREFIX, REGION_NAMES, prefill_block, prefill_buffer

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("nixl_peer.py")
NUM_BLOCKS = 256
BLOCK_LEN = 4096


def test_nixl_is_installed() -> None:
    importlib.import_module("nixl._api")  # fails loudly when the dependency is missing


class Peer:
    """A running prefill process and the address it published."""

    def __init__(self, seed: int, env: dict[str, str], poll_interval_s: float | None = None) -> None:
        self.seed = seed
        extra = [] if poll_interval_s is None else ["--poll-interval", str(poll_interval_s)]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(PEER),
                "--num-blocks",
                str(NUM_BLOCKS),
                "--block-len",
                str(BLOCK_LEN),
                "--seed",
                str(seed),
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        hello = self._next_message()
        self.pid: int = hello["pid"]
        self.address: dict[str, Any] = hello["address"]
        self.buf = prefill_buffer(NUM_BLOCKS, BLOCK_LEN, seed)

    def _next_message(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        self.proc.wait(timeout=10)
        raise RuntimeError(f"peer exited with {self.proc.returncode} before publishing its address")

    def served(self) -> list[str]:
        """Stop the peer gracefully and return every transfer id it was notified about."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(timeout=10)
        ids: list[str] = []
        for line in out.splitlines():
            if line.startswith(PREFIX):
                ids.extend(json.loads(line[len(PREFIX) :])["served"])
        return ids

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case a test stopped it
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def ucx_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def start_peer(ucx_env: dict[str, str]) -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def start(seed: int, poll_interval_s: float | None = None, **extra_env: str) -> Peer:
        peer = Peer(seed, {**ucx_env, **extra_env}, poll_interval_s)
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.kill()


@contextmanager
def decode_side(pull_timeout_s: float) -> Iterator[tuple[NixlTransport, list[np.ndarray]]]:
    """Decode side in this process, with a DIFFERENT layout (one dense buffer per region); closed after.
    UCX reads its environment (UCX_TLS) when the transport is made: set it first."""
    bufs = [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in REGION_NAMES]
    transport = NixlTransport(pull_timeout_s=pull_timeout_s)
    try:
        transport.register(
            [KVRegion.dense(n, b.ctypes.data, BLOCK_LEN, NUM_BLOCKS) for n, b in zip(REGION_NAMES, bufs, strict=True)]
        )
        yield transport, bufs
    finally:
        transport.close()


@pytest.fixture
def decode(ucx_env: dict[str, str]) -> Iterator[tuple[NixlTransport, list[np.ndarray]]]:
    with decode_side(pull_timeout_s=5.0) as side:
        yield side


def wait_for(transport: NixlTransport, tid: str, bound_s: float) -> tuple[PullResult, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        for res in transport.poll():
            assert res.transfer_id == tid
            return res, time.monotonic() - t0
        time.sleep(0.0005)
    raise AssertionError(f"no result for {tid} within {bound_s}s")


def assert_pulled(peer: Peer, bufs: list[np.ndarray], src: np.ndarray, dst: np.ndarray) -> None:
    for r, local in enumerate(bufs):
        blocks = local.reshape(NUM_BLOCKS, BLOCK_LEN)
        for s, d in zip(src, dst, strict=True):
            np.testing.assert_array_equal(blocks[d], prefill_block(peer.buf, r, int(s), BLOCK_LEN))
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
        assert not blocks[untouched].any(), "a block outside the request was written"


def test_scattered_pull_moves_exact_bytes_and_notifies_prefill(start_peer, decode) -> None:
    transport, bufs = decode
    peer = start_peer(seed=11)
    rng = np.random.default_rng(5)
    n = 160
    src = rng.permutation(NUM_BLOCKS)[:n]
    dst = rng.permutation(NUM_BLOCKS)[:n]  # independent permutation: nothing merges
    req = PullRequest("xfer-1", 7, peer.address, src.tolist(), dst.tolist())
    transport.start_pull(req)
    res, _ = wait_for(transport, "xfer-1", 10.0)
    assert res.ok, res.error
    assert res.nbytes == n * BLOCK_LEN * len(REGION_NAMES)
    assert_pulled(peer, bufs, src, dst)

    # A second pull reuses the cached peer and its prepared descriptors.
    src2, dst2 = np.arange(10, 20), np.setdiff1d(np.arange(NUM_BLOCKS), dst)[:10]
    transport.start_pull(PullRequest("xfer-2", 8, peer.address, src2.tolist(), dst2.tolist()))
    res2, _ = wait_for(transport, "xfer-2", 10.0)
    assert res2.ok, res2.error
    assert_pulled(peer, bufs, np.concatenate([src, src2]), np.concatenate([dst, dst2]))
    assert sorted(peer.served()) == ["xfer-1", "xfer-2"]


def test_second_pullers_first_pull_completes_with_the_prefill_polled_at_idle_cadence(start_peer, decode) -> None:
    # 1P2D: the second decode's first contact (metadata load, UCX wireup, an emulated READ that the
    # target must progress) while the prefill's transfer thread polls only at its idle cadence, as it
    # does between handoffs. Both decodes get their exact bytes; the prefill is told of both reads.
    first, first_bufs = decode
    peer = start_peer(seed=18, poll_interval_s=_IDLE_POLL_S)
    first.start_pull(PullRequest("d0-first", 9, peer.address, [5, 6, 7], [1, 2, 3]))
    res, _ = wait_for(first, "d0-first", 30.0)
    assert res.ok, res.error
    assert_pulled(peer, first_bufs, np.array([5, 6, 7]), np.array([1, 2, 3]))

    bufs = [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in REGION_NAMES]
    second = NixlTransport(pull_timeout_s=30.0)
    try:
        second.register(
            [KVRegion.dense(n, b.ctypes.data, BLOCK_LEN, NUM_BLOCKS) for n, b in zip(REGION_NAMES, bufs, strict=True)]
        )
        src, dst = np.array([200, 9, 77, 78]), np.array([0, 40, 41, 255])
        second.start_pull(PullRequest("d1-first", 10, peer.address, src.tolist(), dst.tolist()))
        res2, _ = wait_for(second, "d1-first", 30.0)
        assert res2.ok, res2.error
        assert_pulled(peer, bufs, src, dst)
        assert sorted(peer.served()) == ["d0-first", "d1-first"]
    finally:
        second.close()


def test_pull_from_killed_peer_fails_cleanly_within_bound(start_peer, decode) -> None:
    transport, _ = decode
    peer = start_peer(seed=12)
    transport.start_pull(PullRequest("warm", 1, peer.address, [1, 2, 3], [4, 5, 6]))
    assert wait_for(transport, "warm", 10.0)[0].ok

    peer.kill()  # SIGKILL: no goodbye on the wire
    for tid in ("after-kill", "again"):  # the second one goes through the peer-reload path
        transport.start_pull(PullRequest(tid, 2, peer.address, [7, 8], [9, 10]))
        res, _ = wait_for(transport, tid, 8.0)
        assert not res.ok and isinstance(res.error, PeerUnreachable), res.error
        assert res.error.retryable and res.error.code == "transport_peer_unreachable"
        # PeerUnreachable, not PullTimeout: the death was detected, not waited out (no timing asserted)


def pull_from_a_stopped_peer(start_peer: Callable[..., Peer], transport: NixlTransport, tid: str, seed: int) -> Peer:
    """A 64-block pull from a TCP peer frozen with SIGSTOP: over UCX's TCP transport a READ is emulated and
    needs the target to make progress, so the pull hangs until the peer dies or the deadline fires (the
    test sets UCX_TLS=tcp before it makes `transport`)."""
    peer = start_peer(seed=seed, UCX_TLS="tcp")
    os.kill(peer.pid, signal.SIGSTOP)
    transport.start_pull(PullRequest(tid, seed, peer.address, list(range(64)), list(range(64))))
    return peer


def test_peer_killed_mid_transfer_fails_before_the_deadline(start_peer, ucx_env, monkeypatch) -> None:
    # A stopped peer holds the READ open; killing it must end the pull with PeerUnreachable long before
    # the 8 s deadline.
    monkeypatch.setenv("UCX_TLS", "tcp")
    with decode_side(pull_timeout_s=8.0) as (transport, _):
        peer = pull_from_a_stopped_peer(start_peer, transport, "mid", seed=17)
        time.sleep(0.3)
        assert transport.poll() == []  # still stuck, as intended
        peer.kill()
        res, _ = wait_for(transport, "mid", 8.0)
        assert not res.ok and isinstance(res.error, PeerUnreachable), res.error  # not the 8 s PullTimeout


def test_peer_dead_before_first_contact_is_unreachable(start_peer, decode) -> None:
    transport, _ = decode
    peer = start_peer(seed=13)
    peer.kill()
    transport.start_pull(PullRequest("never", 3, peer.address, [0], [0]))
    res, _ = wait_for(transport, "never", 8.0)
    assert not res.ok and isinstance(res.error, PeerUnreachable), res.error


def test_stalled_peer_times_out_then_a_fresh_peer_works(start_peer, ucx_env, monkeypatch) -> None:
    # A SIGSTOPped prefill stalls the pull until our deadline fires.
    monkeypatch.setenv("UCX_TLS", "tcp")
    with decode_side(pull_timeout_s=1.0) as (transport, bufs):
        pull_from_a_stopped_peer(start_peer, transport, "stall", seed=14)
        res, took = wait_for(transport, "stall", 5.0)
        assert not res.ok and isinstance(res.error, PullTimeout), res.error
        assert took >= 0.9  # the deadline, not before it

        fresh = start_peer(seed=15, UCX_TLS="tcp")
        src, dst = np.array([3, 1, 2]), np.array([100, 50, 75])
        transport.start_pull(PullRequest("fresh", 5, fresh.address, src.tolist(), dst.tolist()))
        res2, _ = wait_for(transport, "fresh", 10.0)
        assert res2.ok, res2.error
        for r, local in enumerate(bufs):
            blocks = local.reshape(NUM_BLOCKS, BLOCK_LEN)
            for s, d in zip(src, dst, strict=True):
                np.testing.assert_array_equal(blocks[d], prefill_block(fresh.buf, r, int(s), BLOCK_LEN))


def test_bad_requests_are_rejected_synchronously(start_peer, decode) -> None:
    transport, _ = decode
    peer = start_peer(seed=16)
    with pytest.raises(InvalidPull, match="2 ids but local_block_ids has 1"):
        transport.start_pull(PullRequest("bad", 1, peer.address, [0, 1], [0]))
    with pytest.raises(InvalidPull, match="out of range"):
        transport.start_pull(PullRequest("bad", 1, peer.address, [NUM_BLOCKS], [0]))
    with pytest.raises(InvalidPull, match="kind"):
        transport.start_pull(PullRequest("bad", 1, {**peer.address, "kind": "llmdatadist"}, [0], [0]))
    other = dict(peer.address)
    other["regions"] = [dict(r, block_len=BLOCK_LEN * 2, stride=BLOCK_LEN * 4) for r in peer.address["regions"]]
    with pytest.raises(InvalidPull, match="region 0 differs"):
        transport.start_pull(PullRequest("bad", 1, other, [0], [0]))
    with pytest.raises(InvalidPull, match="not valid base64"):
        transport.start_pull(PullRequest("bad", 1, {**peer.address, "agent_metadata": "!!"}, [0], [0]))
    with pytest.raises(InvalidPull, match="metadata is for 'peer-16'"):
        transport.start_pull(PullRequest("bad", 1, {**peer.address, "agent_name": "someone-else"}, [0], [0]))
    assert transport.poll() == []
    transport.start_pull(PullRequest("good", 1, peer.address, [0], [0]))  # the peer is still usable
    assert wait_for(transport, "good", 10.0)[0].ok

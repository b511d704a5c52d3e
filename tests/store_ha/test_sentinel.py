"""Sentinel: the metaserver follows a failover of its Redis without a restart, and loses no rule.

Real processes on loopback: a master, one replica and three Sentinels (`servers.SentinelGroup`), the
metaserver app over real HTTP (uvicorn), the official `MetaClient`. The master is killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import open_store

from pdgate.errors import Code
from pdgate.meta_client import MetaClient, MetaConflict, MetaError, MetaGone, MetaUnavailable
from pdgate.models import Handoff, HandoffCreate, HandoffState, KVLocation
from tests.store_ha.servers import BOUND_S, SentinelGroup, crash, redis_cli
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

pytestmark = pytest.mark.store_ha

S = HandoffState
LOC = KVLocation(block_ids=[[1, 2]], num_tokens=16, engine_id="eng-p", host="10.0.0.1")
RESULTS = Path(__file__).resolve().parents[2] / "build" / "store_ha"


@dataclass
class Stream:
    """What the handoff stream saw; every answer is sorted into one of these."""

    loop: asyncio.AbstractEventLoop
    done: int = 0
    kv_keys: list[int] = field(default_factory=list)
    double_claims: list[str] = field(default_factory=list)
    unavailable: int = 0
    abandoned_creates: int = 0
    unexpected: list[str] = field(default_factory=list)
    killed_at: float | None = None
    first_ok_after_kill: float | None = None
    last_503: float | None = None
    done_after_kill: int = 0
    stop: bool = False
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def until_done(self, count: int, deadline: float) -> None:
        """Wait until `count` handoffs completed (after the kill, once there was one), or `deadline`."""
        while (self.done_after_kill if self.killed_at is not None else self.done) < count and not self.unexpected:
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), max(0.0, deadline - self.loop.time()))
            if self.loop.time() >= deadline:
                return

    def ok(self, started: float) -> None:
        """A success of a call started at `started` (only calls sent after the kill measure recovery)."""
        if self.killed_at is not None and started > self.killed_at and self.first_ok_after_kill is None:
            self.first_ok_after_kill = self.loop.time()

    def summary(self) -> str:
        return (
            f"done={self.done} after_kill={self.done_after_kill} 503s={self.unavailable} "
            f"dropped_creates={self.abandoned_creates} unexpected={self.unexpected[:3]}"
        )


async def _answered(stream: Stream, call: Callable[[], Awaitable[object]]) -> object:
    """Run `call()` again while it answers the typed 503 `store_unavailable`; any other answer ends it
    (returned when it is a success or a ledger refusal, recorded as unexpected otherwise)."""
    while True:
        started = stream.loop.time()
        try:
            result = await call()
            stream.ok(started)
            return result
        except MetaUnavailable as exc:
            if exc.code is not Code.STORE_UNAVAILABLE or exc.status != 503:
                stream.unexpected.append(f"{exc.status} {exc.code}: {exc.detail}")
                return exc
            stream.unavailable += 1
            stream.last_503 = stream.loop.time()
            await asyncio.sleep(0.02)
        except (MetaConflict, MetaGone) as exc:
            return exc
        except MetaError as exc:
            stream.unexpected.append(f"{exc.status} {exc.code}: {exc.detail}")
            return exc


def _landed(answer: object, state: HandoffState) -> bool:
    """A success, or a refusal saying an earlier try (answered 503) already made the move."""
    if isinstance(answer, Handoff):
        return True
    return isinstance(answer, MetaError) and answer.current_state is state


async def _worker(meta: MetaClient, n: int, stream: Stream) -> None:
    i = 0
    while not stream.stop:
        i += 1
        prefill = f"p{n}"
        started = stream.loop.time()
        try:
            rec = await meta.create_handoff(HandoffCreate(prefill_instance_id=prefill, transfer_id=f"w{n}-{i}"))
        except MetaUnavailable as exc:
            # The create may or may not have landed; this id is dropped (a router mints a fresh one).
            stream.unavailable += exc.code is Code.STORE_UNAVAILABLE
            stream.abandoned_creates += 1
            if exc.code is not Code.STORE_UNAVAILABLE:
                stream.unexpected.append(f"create: {exc.code}")
            await asyncio.sleep(0.02)
            continue
        stream.ok(started)
        stream.kv_keys.append(rec.kv_key)
        await _one_handoff(meta, n, rec.transfer_id, stream)


async def _one_handoff(meta: MetaClient, n: int, tid: str, stream: Stream) -> None:
    """READY, two decodes racing to claim, DONE by the winner; each step retried through 503s."""
    if not _landed(await _answered(stream, partial(meta.mark_ready, tid, LOC)), S.READY):
        stream.unexpected.append(f"{tid}: ready not applied")
        return
    decodes = (f"d{n}a", f"d{n}b")
    answers = await asyncio.gather(*(_answered(stream, partial(meta.claim, tid, d)) for d in decodes))
    claims = sorted(((a, d) for d, a in zip(decodes, answers, strict=True) if isinstance(a, Handoff)), key=_at)
    # Two claims are one too many only while the first one's lease holds: a claim answered after its
    # retries outlasted the other's lease is the sweeper's return to READY, which `max_claims` bounds.
    overlapping = any(b.updated_at < (a.deadline or 0.0) for (a, _), (b, _) in itertools.pairwise(claims))
    if not claims or overlapping:
        stream.double_claims.append(f"{tid}: {[d for _, d in claims]} {answers}")
        return
    winners = [claims[-1][1]]
    if not _landed(await _answered(stream, partial(meta.done, tid, winners[0])), S.DONE):
        stream.unexpected.append(f"{tid}: done not applied")
        return
    stream.done += 1
    if stream.killed_at is not None:
        stream.done_after_kill += 1
    stream.progress.set()


def _at(claim: tuple[Handoff, str]) -> float:
    return claim[0].updated_at


async def test_failover_under_a_stream_of_handoffs(sentinel_group: SentinelGroup) -> None:
    group = sentinel_group
    # wait_replicas=1: an answer is given once the replica holds the write, so the promoted replica
    # has every transition a caller heard about (without it, the last ones could be lost). Writes then
    # need a replica: the dead server is restarted as the new master's replica once Sentinel has named
    # one, as a supervisor that asks Sentinel before starting Redis would.
    url = group.url(f"t{uuid.uuid4().hex[:8]}") + "&wait_replicas=1&wait_timeout_ms=1000"
    settings = MetaSettings(store=url, sweep_interval_s=0.05)
    loop = asyncio.get_running_loop()
    stream = Stream(loop)
    old_master = group.master.port
    with UvicornThread(create_app(settings)) as server:
        async with MetaClient(server.url, timeout=10) as meta:
            workers = [asyncio.create_task(_worker(meta, n, stream)) for n in range(6)]
            try:
                await stream.until_done(60, loop.time() + 120)  # bounds on the waits, not speed checks
                stream.killed_at = loop.time()
                crash(group.master)
                await asyncio.to_thread(
                    wait_until, lambda: group.master_port() != old_master, timeout=60, what="Sentinel promoted"
                )
                promoted, new_master = loop.time(), group.master_port()
                group.master.extra_args += ["--replicaof", "127.0.0.1", str(new_master)]
                group.master.start(BOUND_S)  # empty (no persistence): a full resync from the new master
                await stream.until_done(40, loop.time() + 120)
            finally:
                stream.stop = True
                await asyncio.gather(*workers)
    assert stream.unexpected == [], stream.summary()
    assert stream.double_claims == [], stream.double_claims[:5]
    assert len(stream.kv_keys) == len(set(stream.kv_keys)), "a kv_key was handed out twice"
    assert stream.unavailable > 0, "the failover window was never seen: the test did not test it"
    assert stream.done_after_kill >= 40, f"service did not come back: {stream.summary()}"
    assert new_master == group.replica.port != old_master
    assert stream.first_ok_after_kill is not None and stream.killed_at is not None
    recovery = {
        "sentinel_promoted_after_s": round(promoted - stream.killed_at, 3),
        "first_success_after_kill_s": round(stream.first_ok_after_kill - stream.killed_at, 3),
        "last_503_after_kill_s": round((stream.last_503 or stream.killed_at) - stream.killed_at, 3),
        "down_after_ms": group.down_after_ms,
        "handoffs_done": stream.done,
        "calls_answered_503": stream.unavailable,
        "creates_dropped_on_503": stream.abandoned_creates,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sentinel_failover.json").write_text(json.dumps(recovery, indent=2) + "\n")
    print(f"\nsentinel failover: {recovery}")


def _in_sync(group: SentinelGroup) -> bool:
    info = dict(
        line.split(":", 1) for line in redis_cli(group.master.port, "info", "replication").splitlines() if ":" in line
    )
    return info.get("slave0", "").endswith(f"offset={info['master_repl_offset']},lag=0") or (
        f"offset={info['master_repl_offset']}," in info.get("slave0", "")
    )


async def test_kv_keys_do_not_repeat_when_a_lagging_replica_is_promoted(sentinel_group: SentinelGroup) -> None:
    """The replica is frozen (SIGSTOP, its link cut) while the master hands out keys, then the master
    dies: the replica that Sentinel promotes never saw those keys. The next keys must still be new."""
    group = sentinel_group
    store = open_store(group.url(f"t{uuid.uuid4().hex[:8]}"))  # asynchronous replication, the default
    now = asyncio.get_running_loop().time

    async def create(tag: str, n: int) -> list[Handoff]:
        return list(
            await asyncio.gather(
                *(
                    store.create_handoff(
                        HandoffCreate(prefill_instance_id="p0"),
                        transfer_id=f"{tag}{i}",
                        now=now(),
                        pending_lease_s=60,
                        ready_lease_s=60,
                    )
                    for i in range(n)
                )
            )
        )

    try:
        await create("before", 20)
        wait_until(lambda: _in_sync(group), what="replica caught up")
        assert group.replica.pid is not None
        # Freeze the replica and cut its link (else the kernel would still buffer the stream for it).
        os.kill(group.replica.pid, signal.SIGSTOP)
        try:
            redis_cli(group.master.port, "client", "kill", "type", "replica")
            unreplicated = await create("lagged", 50)
            crash(group.master)
        finally:
            os.kill(group.replica.pid, signal.SIGCONT)
        deadline = now() + 60  # a bound on the wait, not a speed check
        while True:
            try:
                after = await create("after", 50)
                break
            except MetaError as exc:
                assert exc.code is Code.STORE_UNAVAILABLE, exc
                assert now() < deadline, f"no master after 60 s; Sentinel says:\n{group.sentinel_log()}"
                await asyncio.sleep(0.05)
        assert group.master_port() == group.replica.port
        # The lag is real: the new master never saw the records made while its replica was frozen.
        assert [await store.get_handoff(h.transfer_id) for h in unreplicated] == [None] * 50
        lagged_keys = {h.kv_key for h in unreplicated}
        assert not lagged_keys & {h.kv_key for h in after}, "a kv_key issued by the dead master came back"
        assert min(h.kv_key for h in after) > max(lagged_keys)
    finally:
        await store.close()

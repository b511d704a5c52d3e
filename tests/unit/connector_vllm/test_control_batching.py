"""The control thread batches its ledger calls: against a real metaserver over a socket, N commands waiting
together go out as one `POST /v1/handoffs/batch`, each gets its own answer, the retry rules still hold,
and the queue depth and per-call latency reach the stats file."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.control import ControlThread
from pdgate.connector.messages import (
    Abort,
    Claim,
    Claimed,
    Done,
    DoneResult,
    MarkReady,
    ReadyRecorded,
    Result,
)
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.meta_client import MetaClient
from pdgate.models import (
    BatchClaim,
    BatchCreate,
    BatchReady,
    Handoff,
    HandoffState,
    KVLocation,
)
from tests.support.meta import store_url, sync_meta, uid
from tests.support.ports import wait_until
from tests.support.redis import RedisServer
from tests.support.servers import UvicornThread

S = HandoffState
LOCATION = KVLocation(block_ids=[[1, 2, 3]], num_tokens=48)
N = 24


def config(url: str, role: str, **over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url=url, instance_id=uid(role[0]), url="http://127.0.0.1:8100", model="tiny", role=role
    )
    base.update(over)
    return ConnectorConfig(**base)


def handoffs(url: str, n: int, *, ready: bool = False, claimed_by: str | None = None) -> list[str]:
    ids = [uid("t") for _ in range(n)]

    async def run(c: MetaClient) -> None:
        await c.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in ids])
        if ready or claimed_by:
            await c.batch([BatchReady(transfer_id=t, location=LOCATION) for t in ids])
        if claimed_by:
            await c.batch([BatchClaim(transfer_id=t, decode_instance_id=claimed_by) for t in ids])

    sync_meta(url, run)
    return ids


def requests_seen(url: str) -> dict[str, float]:
    """How many requests the metaserver answered per route (from its own /metrics)."""
    text = httpx.get(f"{url}/metrics").text
    counts: dict[str, float] = {}
    for route, value in re.findall(r'request_seconds_count\{method="\w+",route="([^"]+)",status="\d+"\} (\S+)', text):
        counts[route] = counts.get(route, 0.0) + float(value)
    for name in ("batch_items_count", "batch_items_sum"):
        m = re.search(rf"pdgate_metaserver_{name} (\S+)", text)
        counts[name] = float(m.group(1)) if m else 0.0
    return counts


class Results:
    """What the control thread answered, drained as the engine thread does; kept until asked for."""

    def __init__(self, control: ControlThread) -> None:
        self.control = control
        self.kept: list[Result] = []

    def wait(self, kind: type, want: set[str], timeout: float = 15.0) -> dict[str, Any]:
        """The results of `kind` for every transfer id in `want`."""

        def got() -> dict[str, Any]:
            return {
                r.transfer_id: r for r in self.kept if isinstance(r, kind) and getattr(r, "transfer_id", "") in want
            }

        def seen() -> bool:
            self.kept.extend(self.control.drain())
            return len(got()) == len(want)

        wait_until(seen, timeout=timeout, what=f"{len(want)} {kind.__name__}")
        return got()


@pytest.fixture
def server() -> Iterator[UvicornThread]:
    """A metaserver of this test's own, so its request counts are this test's alone."""
    srv = UvicornThread(create_app(MetaSettings(store="memory://"))).start()
    yield srv
    srv.stop()


def test_n_waiting_claims_go_out_as_one_request(server: UvicornThread) -> None:
    url = server.url
    ids = handoffs(url, N, ready=True)
    control = ControlThread(config(url, "decode"))
    results = Results(control)
    try:
        before = requests_seen(url)
        control.submit([Claim(t) for t in ids])
        claimed = results.wait(Claimed, set(ids))
        after = requests_seen(url)
        assert after["/v1/handoffs/batch"] - before["/v1/handoffs/batch"] == 1
        assert after["batch_items_sum"] - before["batch_items_sum"] == N
        assert after.get("/v1/handoffs/{transfer_id}/claim", 0) == 0  # no single calls at all
        assert {c.handoff.state for c in claimed.values()} == {S.CLAIMED}
        assert {c.handoff.decode_instance_id for c in claimed.values()} == {control._cfg.instance_id}

        control.submit([Done(t) for t in ids])
        done = results.wait(DoneResult, set(ids))
        assert all(d.valid and d.code is None for d in done.values())
        assert requests_seen(url)["/v1/handoffs/batch"] - after["/v1/handoffs/batch"] == 1
        snap = control.batcher.snapshot()
        assert (snap["calls"], snap["requests"], snap["queue_depth_max"]) == (2 * N, 2, N)
    finally:
        control.close()


def test_every_kind_of_call_waiting_together_rides_in_one_request(server: UvicornThread) -> None:
    """READY, claim, DONE and abort of one step: one request, each command its own answer."""
    url = server.url
    cfg = config(url, "both")
    pending = handoffs(url, 4)
    ready = handoffs(url, 4, ready=True)
    mine = handoffs(url, 4, claimed_by=cfg.instance_id)
    doomed = handoffs(url, 4, ready=True)
    control = ControlThread(cfg)
    results = Results(control)
    try:
        before = requests_seen(url)["/v1/handoffs/batch"]
        control.submit(
            [
                *(MarkReady(t, LOCATION) for t in pending),
                *(Claim(t) for t in ready),
                *(Done(t) for t in mine),
                *(Abort(t, "client gone") for t in doomed),
            ]
        )
        recorded = results.wait(ReadyRecorded, set(pending))
        claimed = results.wait(Claimed, set(ready))
        done = results.wait(DoneResult, set(mine))

        def states() -> set[HandoffState]:
            async def read(c: MetaClient) -> set[HandoffState]:
                return {(await c.get_handoff(t)).state for t in doomed}

            return sync_meta(url, read)

        wait_until(lambda: states() == {S.ABORTED}, what="aborts")
        assert requests_seen(url)["/v1/handoffs/batch"] - before == 1
        assert all(r.kv_key for r in recorded.values())
        assert all(c.handoff.state is S.CLAIMED for c in claimed.values())
        assert all(d.valid for d in done.values())
    finally:
        control.close()


def test_an_unreachable_metaserver_is_retried_for_each_call_of_the_batch(redis_server: RedisServer) -> None:
    """The retry rule of MarkReady (retry while unreachable) holds for calls that share a batch."""
    store = store_url("redis", redis_server)
    first = UvicornThread(create_app(MetaSettings(store=store))).start()
    port = first.port
    ids = handoffs(first.url, 6)
    first.stop()
    control = ControlThread(config(first.url, "prefill", kv_lease_s=30.0))
    results = Results(control)
    second: UvicornThread | None = None
    try:
        control.submit([MarkReady(t, LOCATION) for t in ids])
        time.sleep(0.5)
        assert control.drain() == []  # still retrying: neither recorded nor failed
        second = UvicornThread(create_app(MetaSettings(store=store)), port=port).start()
        recorded = results.wait(ReadyRecorded, set(ids))
        assert all(r.kv_key for r in recorded.values())
        states = sync_meta(second.url, lambda c: asyncio.gather(*(c.get_handoff(t) for t in ids)))
        assert {h.state for h in states if isinstance(h, Handoff)} == {S.READY}
    finally:
        control.close()
        if second is not None:
            second.stop()


def test_queue_depth_and_call_latency_reach_the_stats_file(server: UvicornThread, tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    ids = handoffs(server.url, 8, ready=True)
    control = ControlThread(config(server.url, "decode", stats_file=str(path)))
    results = Results(control)
    try:
        control.submit([Claim(t) for t in ids])
        results.wait(Claimed, set(ids))
        control.publish_stats({"counters": {}})

        def written() -> dict[str, Any] | None:
            if not path.exists():
                return None
            data: dict[str, Any] = json.loads(path.read_text())
            return data if data.get("control", {}).get("calls") == 8 else None

        wait_until(lambda: written() is not None, what="stats with the control thread's numbers")
        stats = written()
        assert stats is not None
        control_stats = stats["control"]
        assert control_stats["queue_depth"] == 0 and control_stats["queue_depth_max"] == 8
        assert control_stats["requests"] == 1
        assert control_stats["call_ms"]["n"] == 8 and control_stats["call_ms"]["max"] >= control_stats["call_ms"]["p50"]
    finally:
        control.close()

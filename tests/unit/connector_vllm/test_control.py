"""The control thread against a real metaserver over HTTP: registration that survives an absent metaserver,
claims that wait while a handoff is PENDING, the event feed's liveness, and a clean goodbye."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.control import ControlThread
from pdgate.connector.messages import Claim, Claimed, ClaimFailed, Register, Registered, Result, Terminal
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.errors import Code
from pdgate.meta_client import MetaClient, MetaNotFound
from pdgate.models import (
    Handoff,
    HandoffCreate,
    HandoffState,
    InstanceLoad,
    InstanceRegistration,
    KVLocation,
    Role,
    TransportKind,
)
from tests.support.meta import sync_meta, uid
from tests.support.ports import free_port, wait_until
from tests.support.servers import UvicornThread


def config(url: str, role: str = "prefill", instance_id: str | None = None, **over: Any) -> ConnectorConfig:
    """A connector's settings with short leases and polls, so a test sees heartbeats and the feed quickly."""
    base: dict[str, Any] = dict(
        metaserver_url=url,
        instance_id=instance_id or uid(role[0]),
        url="http://127.0.0.1:8100",
        model="tiny",
        role=role,
        lease_s=3.0,
        heartbeat_s=0.5,
        feed_wait_s=0.5,
        ready_wait_s=10.0,
    )
    base.update(over)
    return ConnectorConfig(**base)


def registration(cfg: ConnectorConfig) -> InstanceRegistration:
    return InstanceRegistration(
        id=cfg.instance_id, role=Role(cfg.role), url=cfg.url, model=cfg.model, lease_s=cfg.lease_s
    )


LOCATION = KVLocation(block_ids=[[3, 4]], num_tokens=40, block_size=32, transport=TransportKind.NIXL)


def pending_handoff(url: str) -> Handoff:
    """A PENDING handoff from a registered prefill, as the router makes one before the prefill runs."""

    async def create(c: MetaClient) -> Handoff:
        prefill = uid("p")
        await c.register(InstanceRegistration(id=prefill, role=Role.PREFILL, url="http://p:1", model="tiny"))
        return await c.create_handoff(HandoffCreate(prefill_instance_id=prefill))

    return sync_meta(url, create)


class Collector:
    def __init__(self, control: ControlThread) -> None:
        self.control = control
        self.results: list[Result] = []

    def wait_for(self, kind: type, timeout: float = 10.0) -> Any:
        def seen() -> bool:
            self.results.extend(self.control.drain())
            return any(isinstance(r, kind) for r in self.results)

        wait_until(seen, timeout=timeout, what=kind.__name__)
        return next(r for r in self.results if isinstance(r, kind))


@pytest.fixture
def control_and_url(metaserver: UvicornThread) -> Iterator[tuple[ControlThread, ConnectorConfig]]:
    cfg = config(metaserver.url, instance_id=uid("ctl"))
    control = ControlThread(cfg)
    yield control, cfg
    control.close()


def test_registration_waits_for_an_absent_metaserver_and_goodbye_deregisters(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = config(url, instance_id=uid("late"))
    control = ControlThread(cfg)
    server: UvicornThread | None = None
    try:
        control.submit([Register(registration(cfg))])
        time.sleep(0.5)  # it is retrying against nothing; nothing must be reported yet
        assert control.drain() == []
        server = UvicornThread(create_app(MetaSettings(store="memory://")), port=port).start()
        Collector(control).wait_for(Registered)

        def beat() -> float:
            return sync_meta(url, lambda c: c.get_instance(cfg.instance_id)).last_heartbeat

        first = beat()
        wait_until(lambda: beat() > first, what="heartbeat")
        control.close()
        with pytest.raises(MetaNotFound):
            sync_meta(url, lambda c: c.get_instance(cfg.instance_id))
    finally:
        control.close()
        if server is not None:
            server.stop()


def test_claim_waits_while_the_handoff_is_pending(
    control_and_url: tuple[ControlThread, ConnectorConfig], metaserver: UvicornThread
) -> None:
    control, cfg = control_and_url
    url = metaserver.url
    h = pending_handoff(url)
    collector = Collector(control)
    control.submit([Claim(h.transfer_id)])
    time.sleep(0.3)
    assert not [r for r in control.drain() if isinstance(r, (Claimed, ClaimFailed))]  # still PENDING
    sync_meta(url, lambda c: c.mark_ready(h.transfer_id, LOCATION))
    claimed = collector.wait_for(Claimed)
    assert claimed.handoff.state is HandoffState.CLAIMED and claimed.handoff.decode_instance_id == cfg.instance_id
    assert claimed.handoff.location.block_ids == [[3, 4]]


def test_claim_of_an_aborted_handoff_fails_as_gone(
    control_and_url: tuple[ControlThread, ConnectorConfig], metaserver: UvicornThread
) -> None:
    control, _ = control_and_url
    url = metaserver.url
    h = pending_handoff(url)
    sync_meta(url, lambda c: c.abort(h.transfer_id, "test"))
    control.submit([Claim(h.transfer_id)])
    failed = Collector(control).wait_for(ClaimFailed)
    assert failed.code is Code.HANDOFF_TERMINAL


def test_claim_of_a_handoff_another_decode_holds_fails_at_once(
    control_and_url: tuple[ControlThread, ConnectorConfig], metaserver: UvicornThread
) -> None:
    """The connector's side of `pdgate.claim_wait`'s rule (the simulator's is in
    tests/integration/metaserver/test_claim_wait.py): the other decode's claim lapses in half a second,
    well within `ready_wait_s`, so a connector that waited it out would report Claimed instead."""
    control, _ = control_and_url
    url = metaserver.url
    h = pending_handoff(url)
    sync_meta(url, lambda c: c.mark_ready(h.transfer_id, LOCATION))
    sync_meta(url, lambda c: c.claim(h.transfer_id, uid("other-decode"), lease_s=0.5))
    control.submit([Claim(h.transfer_id)])
    collector = Collector(control)
    failed = collector.wait_for(ClaimFailed)
    assert failed.code is Code.ILLEGAL_TRANSITION and "another decode" in failed.message
    assert not [r for r in collector.results if isinstance(r, Claimed)]


def test_feed_reports_terminal_states_and_stays_alive(
    control_and_url: tuple[ControlThread, ConnectorConfig], metaserver: UvicornThread
) -> None:
    control, cfg = control_and_url
    url = metaserver.url
    collector = Collector(control)
    control.submit([Register(registration(cfg))])
    collector.wait_for(Registered)
    wait_until(lambda: control.feed_ok_at is not None, what="feed")
    first = control.feed_ok_at
    assert first is not None
    h = sync_meta(url, lambda c: c.create_handoff(HandoffCreate(prefill_instance_id=cfg.instance_id)))
    sync_meta(url, lambda c: c.abort(h.transfer_id, "client gone"))
    term = collector.wait_for(Terminal)
    assert (term.transfer_id, term.state, term.reason) == (h.transfer_id, "ABORTED", "client gone")
    wait_until(lambda: (control.feed_ok_at or 0) > first, what="the feed to keep polling")


def test_stats_are_written_atomically_and_the_last_one_wins(metaserver: UvicornThread, tmp_path: Path) -> None:
    path = tmp_path / "stats" / "c.json"
    control = ControlThread(config(metaserver.url, instance_id=uid("st"), stats_file=str(path)))
    try:
        for i in range(20):
            control.publish_stats({"counters": {"recv_ok": i}})
        wait_until(lambda: path.exists() and json.loads(path.read_text())["counters"]["recv_ok"] == 19, what="stats")
        assert [p.name for p in path.parent.iterdir()] == ["c.json"]  # no temp files left behind
    finally:
        control.close()


def test_the_load_reaches_the_registry_at_the_next_heartbeat_and_publishing_wakes_nothing(
    metaserver: UvicornThread, tmp_path: Path
) -> None:
    """The engine thread publishes the load (and the stats) at almost every step. They are state the loop
    reads on its own timers: a step's publish must not wake the loop (each wake-up is a socket write and a
    GIL hand-over in the step that the model runner waits for), yet the heartbeat reports the newest load
    and the stats file gets the last snapshot."""
    path = tmp_path / "stats.json"
    cfg = config(metaserver.url, instance_id=uid("load"), stats_file=str(path))
    control = ControlThread(cfg)
    try:
        control.submit([Register(registration(cfg))])
        Collector(control).wait_for(Registered)
        wakeups: list[object] = []
        real = control._loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any) -> Any:
            wakeups.append(callback)
            return real(callback, *args)

        control._loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        for i in range(1000):  # a thousand steps, each with a new load and new counters
            control.publish_load(InstanceLoad(running=i % 7, waiting=i % 3, kv_usage=i / 1000))
            control.publish_stats({"counters": {"recv_ok": i}})
        control.publish_load(InstanceLoad(running=5, waiting=2, kv_usage=0.25))
        assert len(wakeups) <= 2  # one stats write armed (a second if the first fired meanwhile); no load

        def reported() -> bool:
            load = sync_meta(metaserver.url, lambda c: c.get_instance(cfg.instance_id)).load
            return (load.running, load.waiting, load.kv_usage) == (5, 2, 0.25)

        wait_until(reported, timeout=5.0, what="the newest load in the registry")
        wait_until(lambda: path.exists() and json.loads(path.read_text())["counters"]["recv_ok"] == 999, what="stats")
    finally:
        control.close()

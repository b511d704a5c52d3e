"""`ControlProcess`: the control thread in a real child process, against a real metaserver over a socket.
Same API and answers as the thread (registration, feed liveness, batched claims, goodbye), and the child
goes away with its parent's pipe; a dead child never raises into the engine thread."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest
from pdgate.connector.control_process import ControlProcess
from pdgate.connector.messages import Claim, Claimed, Register, Registered, Result
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.meta_client import MetaClient, MetaNotFound
from pdgate.models import (
    BatchCreate,
    BatchReady,
    HandoffState,
    InstanceLoad,
    KVLocation,
)
from tests.support.meta import sync_meta, uid
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread
from tests.unit.connector_vllm.test_control import config, registration


@pytest.fixture
def server() -> Iterator[UvicornThread]:
    srv = UvicornThread(create_app(MetaSettings(store="memory://"))).start()
    yield srv
    srv.stop()


def wait_results(control: ControlProcess, kept: list[Result], done: Callable[[list[Result]], bool]) -> None:
    def seen() -> bool:
        kept.extend(control.drain())
        return done(kept)

    wait_until(seen, timeout=30.0, what="results from the control process")


def test_a_prefill_registers_reports_its_feed_and_says_goodbye(server: UvicornThread) -> None:
    cfg = config(server.url, "prefill")
    control = ControlProcess(cfg)
    try:
        assert control.pid != os.getpid()
        kept: list[Result] = []
        control.submit([Register(registration(cfg))])
        wait_results(control, kept, lambda rs: any(isinstance(r, Registered) for r in rs))
        wait_results(control, kept, lambda rs: control.feed_ok_at is not None)
        assert sync_meta(server.url, lambda c: c.get_instance(cfg.instance_id)).id == cfg.instance_id
    finally:
        control.close()
    with pytest.raises(MetaNotFound):  # the child deregistered before it exited
        sync_meta(server.url, lambda c: c.get_instance(cfg.instance_id))
    assert control._proc.returncode == 0


def test_claims_are_answered_across_the_process_boundary(server: UvicornThread) -> None:
    ids = [uid("t") for _ in range(8)]
    location = KVLocation(block_ids=[[5, 6]], num_tokens=32)

    async def prepare(c: MetaClient) -> None:
        await c.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in ids])
        await c.batch([BatchReady(transfer_id=t, location=location) for t in ids])

    sync_meta(server.url, prepare)
    cfg = config(server.url, "decode")
    control = ControlProcess(cfg)
    try:
        kept: list[Result] = []
        control.submit([Claim(t) for t in ids])
        wait_results(control, kept, lambda rs: len([r for r in rs if isinstance(r, Claimed)]) == len(ids))
        claimed = [r for r in kept if isinstance(r, Claimed)]
        assert {c.transfer_id for c in claimed} == set(ids)
        assert all(c.handoff.state is HandoffState.CLAIMED for c in claimed)
        assert all(c.handoff.decode_instance_id == cfg.instance_id for c in claimed)
        assert claimed[0].handoff.location is not None and claimed[0].handoff.location.block_ids == [[5, 6]]
    finally:
        control.close()


def test_a_dead_child_never_raises_into_the_engine_thread(server: UvicornThread) -> None:
    control = ControlProcess(config(server.url, "decode"))
    control.submit([Claim(uid("t"))])
    os.kill(control.pid, signal.SIGKILL)
    control._proc.wait()
    wait_until(lambda: control.drain() == [] and control._gone, what="the parent to notice")
    control.submit([Claim(uid("t"))])  # no exception: the scheduler half's local deadlines take over
    control.close()


def test_the_child_exits_when_the_parent_end_closes(server: UvicornThread) -> None:
    control = ControlProcess(config(server.url, "decode"))
    os.close(control._out)  # what the parent's death does to the pipe
    control._closed = True
    assert control._proc.wait(timeout=30) == 0
    os.close(control._in)


def test_the_load_published_in_the_engine_reaches_the_registry_from_the_child(server: UvicornThread) -> None:
    cfg = config(server.url, "decode")
    control = ControlProcess(cfg)
    try:
        kept: list[Result] = []
        control.submit([Register(registration(cfg))])
        wait_results(control, kept, lambda rs: any(isinstance(r, Registered) for r in rs))
        control.publish_load(InstanceLoad(running=4, waiting=1, kv_usage=0.5))

        def reported() -> bool:
            load = sync_meta(server.url, lambda c: c.get_instance(cfg.instance_id)).load
            return (load.running, load.waiting, load.kv_usage) == (4, 1, 0.5)

        wait_until(reported, timeout=5.0, what="the load in the registry")
    finally:
        control.close()

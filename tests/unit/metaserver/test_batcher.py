"""`pdgate.batcher.Batcher` over a real in-process service (memory store): what rides together, what each
caller gets back, and that an unreachable metaserver reaches every caller as its own MetaUnavailable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings

from pdgate.batcher import Batcher
from pdgate.meta_client import MetaClient, MetaConflict, MetaError, MetaNotFound, MetaUnavailable
from pdgate.models import BatchAbort, BatchClaim, BatchCreate, BatchItem, Handoff, HandoffState
from tests.support.ports import free_port
from tests.support.waiting import until


class Recorder:
    """Sends through the real service, records each request's size, and can hold a request in flight."""

    def __init__(self, local: LocalMetaClient) -> None:
        self.local = local
        self.sizes: list[int] = []
        self.gate: asyncio.Event | None = None

    async def send(self, items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        self.sizes.append(len(items))
        if self.gate is not None:
            await self.gate.wait()
        return await self.local.batch(items)


async def turns(n: int = 10) -> None:
    """Let the event loop run the callbacks and tasks now due (no wall-clock wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    async with running_service(MetaSettings(store="memory://"), sweep=False) as service:
        yield Recorder(LocalMetaClient(service))


async def test_calls_made_together_ride_in_one_request(recorder: Recorder) -> None:
    batcher = Batcher(recorder.send)
    created = await asyncio.gather(
        *(batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id=f"t{i}")) for i in range(10))
    )
    assert recorder.sizes == [10]
    assert [h.transfer_id for h in created] == [f"t{i}" for i in range(10)]
    assert batcher.snapshot()["calls"] == 10 and batcher.depth == 0


async def test_calls_arriving_while_requests_are_out_wait_and_then_go_together(recorder: Recorder) -> None:
    batcher = Batcher(recorder.send, max_in_flight=1)
    recorder.gate = asyncio.Event()
    first = asyncio.ensure_future(batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id="a")))
    await until(lambda: recorder.sizes == [1], what="the first request out (held at the gate)")
    later = [
        asyncio.ensure_future(batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id=f"b{i}")))
        for i in range(5)
    ]
    await until(lambda: batcher.depth == 5, what="the five later calls queued")
    assert recorder.sizes == [1] and batcher.depth == 5 and batcher.in_flight == 1
    recorder.gate.set()
    await asyncio.gather(first, *later)
    assert recorder.sizes == [1, 5]
    assert batcher.snapshot()["queue_depth_max"] == 5


async def test_each_caller_gets_its_own_outcome(recorder: Recorder) -> None:
    batcher = Batcher(recorder.send)
    await batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id="t"))
    outcomes = await asyncio.gather(
        batcher.call(BatchClaim(transfer_id="t", decode_instance_id="d")),  # still PENDING: 409
        batcher.call(BatchAbort(transfer_id="missing")),
        batcher.call(BatchAbort(transfer_id="t", reason="r")),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], MetaConflict) and outcomes[0].current_state is HandoffState.PENDING
    assert isinstance(outcomes[1], MetaNotFound)
    assert isinstance(outcomes[2], Handoff) and outcomes[2].state is HandoffState.ABORTED


async def test_a_cancelled_caller_is_not_sent(recorder: Recorder) -> None:
    batcher = Batcher(recorder.send)
    gone = asyncio.ensure_future(batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id="x")))
    kept = asyncio.ensure_future(batcher.call(BatchCreate(prefill_instance_id="p0", transfer_id="y")))
    gone.cancel()
    assert (await kept).transfer_id == "y"
    assert recorder.sizes == [1]
    assert await recorder.local.service.store.get_handoff("x") is None


async def test_an_unreachable_metaserver_fails_every_call_of_the_request_alike() -> None:
    async with MetaClient(f"http://127.0.0.1:{free_port()}", timeout=1.0) as client:
        batcher = Batcher(client.batch)
        outcomes = await asyncio.gather(
            *(batcher.call(BatchAbort(transfer_id=f"t{i}")) for i in range(3)), return_exceptions=True
        )
    assert all(isinstance(o, MetaUnavailable) for o in outcomes)
    assert len({id(o) for o in outcomes}) == 3  # one exception object per caller


def test_bounds_are_checked() -> None:
    async def send(items: Sequence[BatchItem]) -> list[Handoff | MetaError]:
        return []

    with pytest.raises(ValueError):
        Batcher(send, max_in_flight=0)
    with pytest.raises(ValueError):
        Batcher(send, max_items=100_000)

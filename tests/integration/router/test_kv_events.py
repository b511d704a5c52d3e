"""The KV-event subscriber against vLLM's own ZmqEventPublisher over real ZMQ sockets (no engine boot).

The publisher is vLLM 0.32's class, in this process: its PUB socket, sequence numbers, msgpack batches
and ROUTER replay socket are the engine's. A gap is made for real: batches published under another topic
never pass the subscriber's topic filter, yet sit in the publisher's replay buffer under their numbers
(the test sets the publisher's topic bytes between publishes; it waits until each batch was sent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import NamedTuple

import pytest
from pdgate.router.kv_events import KVEventSubscriber, Source, decode_batch
from pdgate.router.kv_index import KVIndex, Outcome, block_key
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from tests.support.ports import free_port

TOPIC = "kv"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stored(*ids: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=[h(i) for i in ids],
        parent_block_hash=None,
        token_ids=[0] * 16 * len(ids),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(*ids: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h(i) for i in ids], medium="GPU")


class Pub:
    """vLLM's publisher plus what the test needs: waiting until a batch was sent, and hiding batches."""

    def __init__(self, replay: bool = True, buffer_steps: int = 100, ports: tuple[int, int] | None = None) -> None:
        self.port = ports[0] if ports else free_port()
        self.replay_port = (ports[1] if ports else free_port()) if replay else None
        self.pub = ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay_port}" if replay else None,
            buffer_steps=buffer_steps,
            topic=TOPIC,
        )
        self.sent = 0

    def source(self, instance: str = "p1") -> Source:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
        return Source(instance, f"tcp://127.0.0.1:{self.port}", replay, TOPIC)

    async def publish(self, *events: object, hidden: bool = False) -> None:
        self.pub._topic_bytes = b"zz" if hidden else TOPIC.encode()  # another topic: filtered out live
        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))
        self.sent += 1
        await until(lambda: self.pub._event_queue.unfinished_tasks == 0)
        self.pub._topic_bytes = TOPIC.encode()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture
def pubs() -> Iterator[list[Pub]]:
    made: list[Pub] = []
    yield made
    for p in made:
        p.pub.shutdown()


async def connected(pub: Pub, index: KVIndex, instance: str = "p1", timeout: float = 20.0) -> None:
    """PUB/SUB drops what is sent before the subscription is live: send empty batches until one lands."""
    deadline = time.monotonic() + timeout
    while index.expected(instance) is None:
        assert time.monotonic() < deadline, f"no batch of {instance} reached the index in {timeout} s"
        await pub.publish()
        await asyncio.sleep(0.02)


class Followed(NamedTuple):
    index: KVIndex
    sub: KVEventSubscriber
    seen: list[Outcome]  # every batch's outcome, in order


@asynccontextmanager
async def following(pubs: dict[str, Pub], replay_timeout_s: float = 1.0) -> AsyncIterator[Followed]:
    """A subscriber on each instance's publisher, live on all of them before the test publishes (what a
    publisher sends before that is lost, by PUB/SUB's design); closed after, whatever the test did."""
    index = KVIndex()
    seen: list[Outcome] = []
    sub = KVEventSubscriber(index, replay_timeout_s, on_outcome=lambda _i, o: seen.append(o))
    sub.sync({name: pub.source(name) for name, pub in pubs.items()})
    try:
        for name, pub in pubs.items():
            await connected(pub, index, name)
        yield Followed(index, sub, seen)
    finally:
        await sub.close()


async def test_stored_removed_cleared_reach_the_index(pubs: list[Pub]) -> None:
    pubs.append(pub := Pub())
    async with following({"p1": pub}) as (index, _sub, seen):
        await pub.publish(stored(1, 2, 3), stored(7, medium="CPU"))
        await until(lambda: index.size("p1") == 3)
        assert index.matched("p1", [block_key(h(i)) for i in (1, 2, 3)]) == 3
        assert index.block_size("p1") == 16
        await pub.publish(removed(2))
        await until(lambda: index.size("p1") == 2)
        assert index.matched("p1", [block_key(h(1)), block_key(h(2))]) == 1
        await pub.publish(AllBlocksCleared(), stored(9))
        await until(lambda: index.expected("p1") == pub.sent)
        assert index.size("p1") == 1 and index.matched("p1", [block_key(h(9))]) == 1
        assert set(seen) == {Outcome.APPLIED}


async def test_a_gap_is_filled_from_the_replay_socket(pubs: list[Pub]) -> None:
    pubs.append(pub := Pub())
    async with following({"p1": pub}) as (index, _sub, seen):
        await pub.publish(stored(1))
        await pub.publish(stored(2), hidden=True)
        await pub.publish(removed(1), stored(3), hidden=True)
        await pub.publish(stored(4))  # the subscriber sees a gap here and asks for the two it missed
        await until(lambda: index.expected("p1") == pub.sent)
        assert Outcome.GAP in seen
        assert index.matched("p1", [block_key(h(i)) for i in (2, 3, 4)]) == 3
        assert index.matched("p1", [block_key(h(1))]) == 0  # the replayed removal was applied


@pytest.mark.parametrize("replay", [True, False])
async def test_an_unfillable_gap_drops_the_instance_until_fresh_events(pubs: list[Pub], replay: bool) -> None:
    pubs.append(pub := Pub(replay=replay, buffer_steps=2))
    async with following({"p1": pub}, replay_timeout_s=2.0) as (index, _sub, _seen):
        await pub.publish(stored(1, 2))
        for i in range(4):  # more than the replay buffer keeps
            await pub.publish(stored(10 + i), hidden=True)
        await pub.publish(stored(5))
        await until(lambda: index.expected("p1") == pub.sent)
        # what was held before the hole is unknown now: only the fresh batch counts
        assert index.matched("p1", [block_key(h(1))]) == 0
        assert index.matched("p1", [block_key(h(5))]) == 1
        assert index.size("p1") == 1


async def test_an_instance_that_leaves_takes_its_entries(pubs: list[Pub]) -> None:
    pubs.append(a := Pub())
    pubs.append(b := Pub())
    async with following({"p1": a, "p2": b}) as (index, sub, _seen):
        await a.publish(stored(1))
        await b.publish(stored(1))
        await until(lambda: index.size("p1") == 1 and index.size("p2") == 1)
        sub.sync({"p2": b.source("p2")})
        assert sub.following() == ["p2"] and index.instances() == ["p2"]
        await a.publish(stored(2))
        await b.publish(stored(3))
        await until(lambda: index.size("p2") == 2)
        assert index.size("p1") == 0


async def test_close_ends_a_follower_that_lived_through_a_cancel(pubs: list[Pub]) -> None:
    """On Python < 3.12, asyncio.wait_for swallows a cancel that comes as its result does, and a follower
    that swallowed one went on reading for ever while `close` awaited it (two hung test runs here, in the
    gap test, whose replay's end marker raced the close). The replay no longer uses wait_for; `close`
    also cancels again whatever is still running, so a lost cancel costs a second, not the shutdown."""
    pubs.append(pub := Pub())
    index = KVIndex()
    sub = KVEventSubscriber(index)
    cancels: list[int] = []
    follow = sub._follow

    async def swallows_one_cancel(src: Source) -> None:
        try:
            await follow(src)
        except asyncio.CancelledError:
            cancels.append(1)
        await follow(src)  # lives on, as a follower whose cancel was lost did

    sub._follow = swallows_one_cancel  # type: ignore[method-assign]
    sub.sync({"p1": pub.source()})
    await connected(pub, index)
    await asyncio.wait_for(sub.close(), 10.0)
    assert cancels == [1] and sub.following() == []


def test_a_payload_that_is_not_a_batch_is_refused() -> None:
    with pytest.raises(ValueError):
        decode_batch(b"\x93\x01")
    with pytest.raises(ValueError):
        decode_batch(b"not msgpack \xc1")


async def test_the_pool_follower_tracks_instances_as_they_come_and_go(pubs: list[Pub]) -> None:
    from pdgate.router.kv_events import KVEvents
    from pdgate.router.pairing import InstanceView

    from pdgate.models import Role

    pubs.append(pub := Pub())
    kv = KVEvents({}, port=pub.port, replay_port=pub.replay_port)  # derived from the registration's URL
    snapshot: list[tuple[InstanceView, ...]] = [(InstanceView("p1", Role.PREFILL, "http://127.0.0.1:1", "m"),)]
    task = asyncio.create_task(kv.run(lambda: snapshot[0], 0.01))
    try:
        await connected(pub, kv.index)
        await pub.publish(stored(1, 2))
        await until(lambda: kv.index.size("p1") == 2)
        snapshot[0] = ()  # the instance left the pool
        await until(lambda: kv.index.instances() == [])
        assert kv.subscriber is not None and kv.subscriber.following() == []
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert kv.subscriber is None


async def test_a_restarted_engine_numbering_past_the_old_counter_leaves_nothing_stale(pubs: list[Pub]) -> None:
    old = Pub()
    async with following({"p1": old}) as (index, _sub, seen):
        await old.publish(stored(1))
        await until(lambda: index.size("p1") == 1)
        last = index.expected("p1") or 0
        old.pub.shutdown()
        await until(lambda: Outcome.RESTART in seen)  # the connection dropped: what it held is gone
        assert index.size("p1") == 0
        pubs.append(new := Pub(ports=(old.port, old.replay_port or 0)))  # the engine again, same ports
        for _ in range(last + 5):  # its numbers pass the old ones while nobody hears them
            await new.publish(stored(99), hidden=True)
        await connected(new, index)
        await new.publish(stored(2))
        await until(lambda: index.matched("p1", [block_key(h(2))]) == 1)
        assert index.matched("p1", [block_key(h(1))]) == 0

"""Following vLLM's KV events over ZMQ into the router's `KVIndex` (issue #22 item 4). Off by default.

An engine started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'` publishes on a PUB socket, per batch,
the frames (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`): `[ts, [event...], dp_rank]`,
each event a map tagged `type` = BlockStored / BlockRemoved / AllBlocksCleared (vllm 0.32's
`vllm/distributed/kv_events.py`). A DP rank r publishes on the endpoint's port + r. Its ROUTER replay
socket answers a request frame holding a start sequence number (8 bytes) with every buffered batch from
there, as (topic, seq, payload), then an end marker whose seq is -1.

Where the router finds the publishers (decided here): an instance's endpoint is named explicitly
(`--kv-events ID=tcp://host:5557|tcp://host:5558`, the replay endpoint optional) or derived from its
registration (`--kv-events-port 5557 [--kv-events-replay-port 5558]`: the host of its URL, the port + its
DP rank, as vLLM offsets it). The registry does not carry the endpoint itself; deriving it from the URL
needs no change to registration and follows instances as they come and go (`sync`).

One task per instance: a SUB socket, each batch applied in order (`KVIndex.apply`). A gap (PUB drops
messages under load or across a reconnect) asks the replay socket for the missing batches; what the replay
cannot give (no replay endpoint, buffer rotated, no answer within `replay_timeout_s`) drops the instance's
entries until fresh events rebuild them (`KVIndex.resume`). A batch that does not decode counts as lost.
An instance that leaves the pool stops its task and takes its entries (`KVIndex.forget`). A lost connection
(the socket monitor's DISCONNECTED: the engine restarted, or the network dropped batches) forgets the
instance too: a restarted engine numbers from 0 again with an empty cache, and its new numbers can lie
above the old ones, where they would read as a gap "filled" from the new engine's replay on top of stale
entries.

Only blocks on the GPU (medium "GPU" or unstated) are indexed: they are what a request reuses without a
load. Text and chat prompts: the router does not tokenize, so their block hashes are unknown before the
prefill tokenized them; for them the prefill policy falls back to prefix affinity and the decider sees a
cached length of 0 (`policies/cache_aware.py`). Clients that send token ids get precise routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from pdgate.router.kv_index import Cleared, KVEvent, KVIndex, Outcome, Removed, Stored, block_key
from pdgate.router.pairing import InstanceView
from pdgate.router.settings import RouterSettings

__all__ = ["KVEventSubscriber", "KVEvents", "Source", "decode_batch", "parse_sources", "sources_for"]

log = logging.getLogger("pdgate.router.kv_events")

END_SEQ = -1
_GPU = (None, "GPU")


@dataclass(frozen=True, slots=True)
class Source:
    instance: str
    endpoint: str  # the engine's PUB socket
    replay: str | None = None  # its ROUTER replay socket
    topic: str = ""


def parse_sources(items: Iterable[str]) -> dict[str, Source]:
    """`ID=PUB[|REPLAY]` items (the `--kv-events` flag) by instance id."""
    out: dict[str, Source] = {}
    for item in items:
        ident, sep, rest = item.partition("=")
        pub, _, replay = rest.partition("|")
        if not sep or not ident or not pub.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events {item!r}: expected ID=tcp://HOST:PORT[|tcp://HOST:PORT]")
        out[ident] = Source(ident, pub, replay or None)
    return out


def sources_for(
    views: Sequence[InstanceView],
    explicit: dict[str, Source],
    port: int | None = None,
    replay_port: int | None = None,
) -> dict[str, Source]:
    """Each instance's publisher: named in `explicit`, else derived from its URL's host and `port` + its DP
    rank (vLLM's offset); instances with neither are not followed."""
    out: dict[str, Source] = {}
    for v in views:
        src = explicit.get(v.id)
        if src is None and port is not None:
            host = urlsplit(v.url).hostname or "127.0.0.1"
            host = f"[{host}]" if ":" in host else host
            replay = f"tcp://{host}:{replay_port + v.dp_rank}" if replay_port is not None else None
            src = Source(v.id, f"tcp://{host}:{port + v.dp_rank}", replay)
        if src is not None:
            out[v.id] = src
    return out


def _keys(hashes: Any) -> tuple[int, ...]:
    return tuple(block_key(h) for h in hashes)


def decode_batch(payload: bytes) -> list[KVEvent]:
    """A `KVEventBatch` payload as index events; ValueError when it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
        raw_events = batch[1]
        out: list[KVEvent] = []
        for ev in raw_events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                out.append(Cleared())
            elif ev.get("medium") not in _GPU:
                continue
            elif kind == "BlockStored":
                out.append(Stored(_keys(ev["block_hashes"]), int(ev.get("block_size") or 0)))
            elif kind == "BlockRemoved":
                out.append(Removed(_keys(ev["block_hashes"])))
        return out
    except (msgspec.DecodeError, LookupError, TypeError, ValueError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc


class KVEventSubscriber:
    """One following task per instance, feeding one `KVIndex` (module docstring)."""

    def __init__(
        self,
        index: KVIndex,
        replay_timeout_s: float = 1.0,
        on_outcome: Callable[[str, Outcome], None] | None = None,
    ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self._on_outcome = on_outcome
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Source, asyncio.Task[None]]] = {}

    def sync(self, sources: dict[str, Source]) -> None:
        """Follow exactly `sources`: start the new, stop the gone (their entries go), restart the moved."""
        for ident in list(self._tasks):
            src, task = self._tasks[ident]
            if sources.get(ident) != src:
                task.cancel()
                del self._tasks[ident]
                self.index.forget(ident)
        for ident, src in sources.items():
            if ident not in self._tasks:
                task = asyncio.get_running_loop().create_task(self._follow(src), name=f"kv-events {ident}")
                self._tasks[ident] = (src, task)

    def following(self) -> list[str]:
        return sorted(self._tasks)

    async def close(self) -> None:
        """Stop every follower, then the context (`term` would block on a socket still open). A follower
        that lived through a cancel is cancelled again rather than awaited for ever: the router's shutdown
        must not hang on one (`_replayed` says how the replay's read keeps a cancel from being lost)."""
        pending = {t for _, t in self._tasks.values()}
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks.clear()
        self._ctx.term()

    def _count(self, instance: str, outcome: Outcome) -> None:
        if outcome is not Outcome.APPLIED:
            log.info("kv events of %s: %s", instance, outcome.value)
        if self._on_outcome is not None:
            self._on_outcome(instance, outcome)

    async def _follow(self, src: Source) -> None:
        """Read `src`'s batches in order; a lost connection forgets what it held (module docstring)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(src.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:  # first: a batch read after it comes from the new connection
                    await monitor.recv_multipart()
                    self.index.forget(src.instance)  # a restarted engine's cache is empty; a blip lost batches
                    self._count(src.instance, Outcome.RESTART)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3:
                        await self._offer(src, int.from_bytes(frames[1], "big", signed=True), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug must not end the router; the entries go stale-safe
            log.exception("kv events of %s: follower stopped", src.instance)
            self.index.drop(src.instance)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _offer(self, src: Source, seq: int, payload: bytes) -> None:
        """Apply live batch `seq`, replaying first when batches before it are missing."""
        try:
            events = decode_batch(payload)
        except ValueError as exc:
            log.warning("kv events of %s: batch %d dropped (%s)", src.instance, seq, exc)
            self.index.resume(src.instance, seq + 1)
            self._count(src.instance, Outcome.GAP)
            return
        outcome = self.index.apply(src.instance, seq, events)
        if outcome is Outcome.GAP:
            self._count(src.instance, outcome)
            start = self.index.expected(src.instance)
            if src.replay is not None and start is not None:
                await self._replay(src, start)
            outcome = self.index.apply(src.instance, seq, events)
            if outcome is Outcome.GAP:  # the replay did not fill it: drop the entries, start again here
                self.index.resume(src.instance, seq)
                outcome = self.index.apply(src.instance, seq, events)
        self._count(src.instance, outcome)

    async def _replay(self, src: Source, start: int) -> None:
        """Ask `src`'s replay socket for batches from `start` and apply them, within `replay_timeout_s`."""
        assert src.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(src.replay)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            if not await self._replayed(src.instance, sock, asyncio.get_running_loop().time() + self.replay_timeout_s):
                log.warning(
                    "kv events of %s: no replay from %s within %ss", src.instance, src.replay, self.replay_timeout_s
                )
        finally:
            sock.close(linger=0)

    async def _replayed(self, instance: str, sock: zmq.asyncio.Socket, deadline: float) -> bool:
        """Apply replayed batches until the end marker, until one cannot follow in order (True), or until
        `deadline` on the loop's clock (False). Each frame is awaited by the socket's own poll, with what is
        left of the time: not by asyncio.wait_for, which on Python < 3.12 swallows a cancel that comes as
        its result does (the replay's last batch makes the index whole, the router closes the subscriber
        in the same moment), and the follower would then outlive `close`."""
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0 or not await sock.poll(left * 1000):  # POLLIN, the default
                return False
            frames = await sock.recv_multipart()
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return True
            try:
                events = decode_batch(frames[3])
            except ValueError:
                return True  # the rest cannot be applied in order: the caller resumes after the gap
            if self.index.apply(instance, seq, events, replayed=True) is Outcome.GAP:
                return True  # the buffer no longer holds the start: the caller resumes


class KVEvents:
    """The router's KV-event following as one piece: the index the policy reads, the subscriber feeding it,
    and the loop keeping the subscriber on the pool's instances (`run`, started by the app's lifespan)."""

    def __init__(
        self,
        explicit: dict[str, Source],
        port: int | None = None,
        replay_port: int | None = None,
        max_blocks: int = 1 << 20,
        on_outcome: Callable[[str, Outcome], None] | None = None,
    ) -> None:
        self.index = KVIndex(max_blocks)
        self._on_outcome = on_outcome  # each batch's fate, for the metrics
        self.explicit = explicit
        self.port = port
        self.replay_port = replay_port
        self.subscriber: KVEventSubscriber | None = None
        self._task: asyncio.Task[None] | None = None

    def update(self, views: Sequence[InstanceView]) -> None:
        """Follow the publishers of `views` (the pool's snapshot); instances gone take their entries."""
        if self.subscriber is None:
            self.subscriber = KVEventSubscriber(self.index, on_outcome=self._on_outcome)
        self.subscriber.sync(sources_for(views, self.explicit, self.port, self.replay_port))

    @classmethod
    def from_settings(cls, s: RouterSettings, on_outcome: Callable[[str, Outcome], None] | None = None) -> KVEvents:
        explicit = parse_sources(s.kv_events)
        return cls(explicit, s.kv_events_port, s.kv_events_replay_port, s.kv_events_max_blocks, on_outcome)

    def start(self, views: Callable[[], Sequence[InstanceView]], interval_s: float) -> None:
        """Start `run` in the background (the app's lifespan; `stop` ends it)."""
        self._task = asyncio.get_running_loop().create_task(self.run(views, interval_s), name="kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self, views: Callable[[], Sequence[InstanceView]], interval_s: float) -> None:
        """Re-read the pool's snapshot every `interval_s` (the registry refresh's period) until cancelled."""
        seen: Sequence[InstanceView] | None = None
        try:
            while True:
                now = views()
                if now is not seen:  # the pool replaces its snapshot as a whole: identity is change
                    self.update(now)
                    seen = now
                await asyncio.sleep(interval_s)
        finally:
            if self.subscriber is not None:
                await self.subscriber.close()
                self.subscriber = None

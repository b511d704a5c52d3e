"""The scheduler half's control thread: one asyncio loop that owns the `MetaClient`.

Why a thread of its own: vLLM's scheduler hooks run on the engine-core thread between model steps, and
an HTTP call there would stall every request in the batch. Commands (`pdgate.connector.messages`) come in with
`submit()` (scheduled on the loop with `call_soon_threadsafe`), answers go out on a `queue.SimpleQueue`
that the scheduler half drains at its next hook. The feed's liveness is a single float
(`feed_ok_at`) this thread writes and the engine thread reads: a monotonic timestamp, published whole.

The load and the stats snapshot are state, not commands: the engine thread leaves the newest in a slot
(`publish_load`, `publish_stats`) and this thread reads it when it needs it (the heartbeat; the stats
write at most every `_STATS_EVERY_S`). As commands they woke this loop at almost every engine step (the
load's KV use moves as blocks fill): `call_soon_threadsafe`'s wake-up write, then the GIL handed to this
thread and back, took 7.4 % of the decode engine core's samples under 8 concurrent requests (py-spy), in
the step that the model runner waits for.

Per command, the retry rules (decided on the client's exception types, never on messages):
  MarkReady  retry while unreachable, up to the handoff lease; gone/unknown/refused -> free now.
  Claim      `pdgate.claim_wait`'s rule: long-poll while PENDING, up to `ready_wait_s`; retry while
             unreachable; gone/unknown/claimed by another decode -> fail.
  Done       retry while unreachable for a few seconds; gone -> the KV may have been freed: invalid;
             a conflict (our claim lapsed back to READY) -> the record is live, the KV was held: valid.
  Abort      best effort, a few retries; gone/unknown are fine (nothing to abort).
  Check      one try; unknown -> the record is lost, free; unreachable -> keep (local deadline).

Batching: READY, claim, DONE and abort go through a `pdgate.batcher.Batcher`, so every such
call waiting when a request goes out rides in that one `POST /v1/handoffs/batch` (at most
`_MAX_IN_FLIGHT` requests out at once); one engine step's commands are one request, and a backlog never
turns into one round trip per call after the other. Each call still gets its own typed error, so the
retry rules above are the single calls' rules. The queue depth and each call's latency (queued ->
answered) go into the stats file (`control` key) and into a log line every `_REPORT_EVERY_S`.

A failure that reaches the scheduler half carries a `pdgate.errors.Code`: the metaserver client's own
(`MetaError.code`, from the answer's problem body), or one of the control thread's (`KV_NOT_READY` when
no READY came in time, `HANDOFF_TERMINAL` when the long-poll saw the record end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.logs import about
from pdgate.connector.messages import (
    Abort,
    Check,
    CheckResult,
    Claim,
    Claimed,
    ClaimFailed,
    Command,
    Done,
    DoneResult,
    FeedStatus,
    MarkReady,
    ReadyFailed,
    ReadyRecorded,
    Register,
    Registered,
    Result,
    Terminal,
)
from pdgate.connector.registration import Registrar, backoff

from pdgate.batcher import Batcher
from pdgate.claim_wait import ClaimRefused, ClaimRule, claim_handoff
from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient, MetaConflict, MetaError, MetaGone, MetaNotFound, MetaUnavailable
from pdgate.meta_pooled import PooledMetaClient
from pdgate.models import (
    TERMINAL_STATES,
    BatchAbort,
    BatchClaim,
    BatchDone,
    BatchReady,
    Handoff,
    HandoffState,
    InstanceLoad,
    RegisterResponse,
)

__all__ = ["ControlThread"]

logger = logging.getLogger(__name__)

_LONG_POLL_CAP_S = 10.0
_STATS_EVERY_S = 0.2
_MAX_IN_FLIGHT = 2  # batch requests out at once (see the module docstring)
_REPORT_EVERY_S = 30.0


class _BatchedClaims:
    """The claim wait's view of the metaserver: claims ride in the batcher, long-polls go alone."""

    def __init__(self, batcher: Batcher, meta: MetaClient) -> None:
        self._batcher = batcher
        self._meta = meta

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff:
        item = BatchClaim(transfer_id=transfer_id, decode_instance_id=decode_instance_id, lease_s=lease_s)
        return await self._batcher.call(item)

    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff:
        return await self._meta.get_handoff(transfer_id, wait)


def _lean_client(cfg: ConnectorConfig) -> MetaClient:
    """The control thread's client: the one with the fewest GIL hand-overs per call.

    Why not httpx: wherever this thread runs, each event-loop turn or socket call is a GIL hand-over
    (in the engine's process, one it may wait a whole switch interval for). `bench/control.py` counts a
    claim through httpx at 5-8 context switches of this thread, through this client at 2.5-3, and
    measures its median 3-10x lower on a shared 2-core machine (bench/results/control.json).
    """
    return PooledMetaClient(
        cfg.metaserver_url, pool=HttpPool(), admin_token=cfg.metaserver_token, timeout=5.0, owns_pool=True
    )


class ControlThread:
    """Runs metaserver I/O for one scheduler half. Create, `submit()` commands, `drain()` results, `close()`.

    Inside vLLM it runs in a child process (`control_process.ControlProcess`, same API), off the engine's GIL.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        client_factory: Callable[[], MetaClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "pdgate-control",
        emit: Callable[[Result], None] | None = None,
    ) -> None:
        """`emit`: where results go (default: the queue `drain()` reads); `control_process` sends them
        to its parent instead, from this thread."""
        self._cfg = cfg
        self._clock = clock
        self._client_factory = client_factory or (lambda: _lean_client(cfg))
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._emit: Callable[[Result], None] = emit or self._results.put
        self._forwarding = emit is not None  # feed liveness then travels as FeedStatus results too
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._load: InstanceLoad | None = None
        self._registrar: Registrar | None = None
        self._client: MetaClient | None = None
        self._batcher: Batcher | None = None
        self._reported_calls = 0
        self._closed = False
        self.feed_ok_at: float | None = None
        self._pending_stats: dict[str, Any] | None = None
        self._stats_armed = False  # a stats write is scheduled (or its scheduling is on its way to the loop)
        self._stats_lock = threading.Lock()  # the slot and the flag, shared with the engine thread
        self._stats_written_at = float("-inf")
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    # ---- engine-thread API -----------------------------------------------------------------------

    def submit(self, commands: list[Command]) -> None:
        if commands and not self._closed:
            self._loop.call_soon_threadsafe(self._dispatch, commands)

    def publish_load(self, load: InstanceLoad) -> None:
        """The load the next heartbeat reports. No wake-up: the heartbeat reads the newest when it runs."""
        self._load = load

    def publish_stats(self, snapshot: dict[str, Any]) -> None:
        """The counters for `stats_file`: the newest wins; the loop is woken once per write, not per change."""
        if self._closed:
            return
        with self._stats_lock:
            self._pending_stats = snapshot
            if self._stats_armed:
                return
            self._stats_armed = True
        self._loop.call_soon_threadsafe(self._arm_stats)

    def drain(self) -> list[Result]:
        out: list[Result] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self, *, abort_transfer_ids: Sequence[str] = (), timeout: float = 3.0) -> None:
        """Abort what we still hold (best effort), deregister, stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(list(abort_transfer_ids), timeout), self._loop)
        try:
            fut.result(timeout + 1.0)
        except Exception as exc:  # a shutdown that cannot finish must not block the engine's exit
            logger.warning("control thread shutdown incomplete: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    # ---- loop side --------------------------------------------------------------------------------

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = self._client_factory()
        self._batcher = Batcher(self._client.batch, max_in_flight=_MAX_IN_FLIGHT)
        self._loop.call_later(_REPORT_EVERY_S, self._report)
        started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("control task failed: %r", task.exception(), exc_info=task.exception())

    def _dispatch(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, MarkReady):
                self._spawn(self._mark_ready(cmd))
            elif isinstance(cmd, Claim):
                self._spawn(self._claim(cmd))
            elif isinstance(cmd, Done):
                self._spawn(self._done(cmd))
            elif isinstance(cmd, Abort):
                self._spawn(self._abort(cmd))
            elif isinstance(cmd, Check):
                self._spawn(self._check(cmd))
            elif isinstance(cmd, Register):
                self._start_registration(cmd)

    @property
    def _meta(self) -> MetaClient:
        assert self._client is not None
        return self._client

    @property
    def batcher(self) -> Batcher:
        """The ledger-call queue (read its `snapshot()` from the loop's thread, or for a report)."""
        assert self._batcher is not None
        return self._batcher

    def _report(self) -> None:
        """Log the ledger calls since the last report (queue depth, latency), when there were any."""
        self._loop.call_later(_REPORT_EVERY_S, self._report)
        if self.batcher.calls == self._reported_calls:
            return
        snap = self.batcher.snapshot(reset=True)
        calls = snap["calls"] - self._reported_calls
        self._reported_calls = snap["calls"]
        lat = snap["call_ms"]
        logger.info(
            "ledger calls: %d (%d requests so far), queue depth max %d, latency ms p50 %s p99 %s max %s",
            calls,
            snap["requests"],
            snap["queue_depth_max"],
            lat.get("p50"),
            lat.get("p99"),
            lat.get("max"),
        )

    # registration and the event feed

    def _start_registration(self, cmd: Register) -> None:
        if self._registrar is not None:
            logger.warning("instance %s: already registering; ignoring a second registration", cmd.registration.id)
            return
        self._registrar = Registrar(
            self._meta,
            cmd.registration,
            heartbeat_s=self._cfg.heartbeat_s,
            load=lambda: self._load,
            on_registered=self._registered,
        )
        self._spawn(self._registrar.run())
        if self._cfg.can_prefill:
            self._spawn(self._feed(self._registrar))

    def _registered(self, resp: RegisterResponse) -> None:
        self._emit(Registered(resp.instance.id, resp.lease_s))

    async def _feed(self, registrar: Registrar) -> None:
        """Terminal transitions of our handoffs, long-polled; the prefill frees blocks on them."""
        cursor: str | None = None
        attempt = 0
        while True:
            await registrar.registered.wait()
            try:
                batch = await self._meta.events(registrar.instance_id, cursor, wait=self._cfg.feed_wait_s)
            except MetaError as exc:
                if attempt == 0 or attempt % 20 == 0:
                    logger.warning("instance %s: handoff-event feed failed: %s", registrar.instance_id, exc)
                await asyncio.sleep(backoff(attempt, base=0.1, cap=2.0))
                attempt += 1
                continue
            attempt = 0
            cursor = batch.cursor
            for ev in batch.events:
                if ev.state in TERMINAL_STATES:
                    self._emit(Terminal(ev.transfer_id, ev.state.value, ev.reason))
            self.feed_ok_at = self._clock()
            if self._forwarding:
                self._emit(FeedStatus(True, self.feed_ok_at))

    # handoff commands

    async def _mark_ready(self, cmd: MarkReady) -> None:
        deadline = self._clock() + self._cfg.kv_lease_s
        attempt = 0
        while True:
            try:
                h = await self.batcher.call(BatchReady(transfer_id=cmd.transfer_id, location=cmd.location))
            except MetaConflict as exc:
                if exc.current_state in (HandoffState.READY, HandoffState.CLAIMED):
                    # An earlier try landed although its answer was lost: recorded.
                    self._emit(ReadyRecorded(cmd.transfer_id, None, self._cfg.kv_lease_s))
                else:
                    self._emit(ReadyFailed(cmd.transfer_id, exc.code, exc.detail, terminal=True))
                return
            except MetaUnavailable as exc:
                if self._clock() >= deadline:
                    self._emit(ReadyFailed(cmd.transfer_id, exc.code, exc.detail, terminal=False))
                    return
                await asyncio.sleep(backoff(attempt, base=0.05, cap=1.0))
                attempt += 1
                continue
            except MetaError as exc:  # gone, unknown, refused, unauthorized: this READY will never land
                self._emit(ReadyFailed(cmd.transfer_id, exc.code, exc.detail, terminal=True))
                return
            self._emit(ReadyRecorded(cmd.transfer_id, h.kv_key, h.lease_s))
            return

    async def _claim(self, cmd: Claim) -> None:
        """Claim through the batcher, waiting as `pdgate.claim_wait` says (the rule the simulator and the
        router follow too); a decode never takes another decode's claim."""
        rule = ClaimRule(self._cfg.ready_wait_s, poll_cap_s=_LONG_POLL_CAP_S)
        try:
            h = await claim_handoff(
                _BatchedClaims(self.batcher, self._meta),
                cmd.transfer_id,
                self._instance_id(),
                rule=rule,
                lease_s=self._cfg.claim_lease_s,
                clock=self._clock,
            )
        except ClaimRefused as exc:
            self._emit(ClaimFailed(cmd.transfer_id, exc.code, exc.message))
            return
        self._emit(Claimed(cmd.transfer_id, h))

    async def _done(self, cmd: Done) -> None:
        transfer_id = cmd.transfer_id
        deadline = self._clock() + 5.0
        attempt = 0
        while True:
            try:
                await self.batcher.call(BatchDone(transfer_id=transfer_id, decode_instance_id=self._instance_id()))
                self._emit(DoneResult(transfer_id, True))
                return
            except MetaGone as exc:
                # ABORTED/EXPIRED while we read: the prefill may already have reused the blocks.
                self._emit(DoneResult(transfer_id, False, exc.code, exc.detail))
                return
            except MetaConflict as exc:
                # Our claim lapsed back to READY (or another decode claimed it): the record is live, so
                # the prefill still held the blocks while we read them.
                logger.warning(
                    "transfer %s: DONE refused (%s); the KV was still held, using it",
                    transfer_id,
                    exc.detail,
                    extra=about(transfer_id),
                )
                self._emit(DoneResult(transfer_id, True, exc.code, exc.detail))
                return
            except MetaUnavailable as exc:
                if self._clock() >= deadline:
                    self._emit(DoneResult(transfer_id, False, exc.code, exc.detail))
                    return
                await asyncio.sleep(backoff(attempt, base=0.02, cap=0.5))
                attempt += 1
            except MetaError as exc:
                self._emit(DoneResult(transfer_id, False, exc.code, exc.detail))
                return

    async def _abort(self, cmd: Abort) -> None:
        for attempt in range(5):
            try:
                await self.batcher.call(BatchAbort(transfer_id=cmd.transfer_id, reason=cmd.reason))
                return
            except (MetaGone, MetaNotFound, MetaConflict):
                return
            except MetaUnavailable:
                await asyncio.sleep(backoff(attempt, base=0.1, cap=1.0))
            except MetaError as exc:
                logger.warning("transfer %s: abort refused: %s", cmd.transfer_id, exc, extra=about(cmd.transfer_id))
                return
        logger.warning(
            "transfer %s: abort not delivered (metaserver unreachable)", cmd.transfer_id, extra=about(cmd.transfer_id)
        )

    async def _check(self, cmd: Check) -> None:
        try:
            h = await self._meta.get_handoff(cmd.transfer_id)
        except MetaNotFound:
            self._emit(CheckResult(cmd.transfer_id, None, found=False))
        except MetaError:
            self._emit(CheckResult(cmd.transfer_id, None))
        else:
            self._emit(CheckResult(cmd.transfer_id, h.state))

    def _instance_id(self) -> str:
        return self._cfg.instance_id

    def _arm_stats(self) -> None:
        """Schedule the write of the snapshot `publish_stats` left: at most every `_STATS_EVERY_S`, and
        always the last one.

        Even the first change after a quiet spell waits that long: it comes from a request starting or
        ending, and a write then (JSON, percentiles, a file) took the engine's GIL for ~2.5 ms in the
        middle of that request's step (measured on the prefill: READY and the answer both waited)."""
        delay = max(_STATS_EVERY_S, self._stats_written_at + _STATS_EVERY_S - self._clock())
        self._loop.call_later(delay, self._flush_stats)

    def _flush_stats(self) -> None:
        with self._stats_lock:  # a snapshot published from here on arms the next write
            snapshot, self._pending_stats = self._pending_stats, None
            self._stats_armed = False
        if snapshot is not None:
            self._stats_written_at = self._clock()
            self._write_stats(snapshot)

    def _write_stats(self, snapshot: dict[str, Any]) -> None:
        path = self._cfg.stats_file
        if not path:
            return
        control = self._batcher.snapshot() if self._batcher is not None else {}
        snapshot = {**snapshot, "control": control, "pid": os.getpid(), "written_at": time.time()}
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".pdgate-stats-", dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot, f, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("cannot write stats file %s: %s", path, exc)

    async def _shutdown(self, abort_ids: list[str], timeout: float) -> None:
        self._flush_stats()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=0.5)

        async def goodbye() -> None:
            if abort_ids:
                await asyncio.gather(
                    *(self._abort(Abort(t, "prefill instance shutting down")) for t in abort_ids),
                    return_exceptions=True,
                )
            if self._registrar is not None:
                await self._registrar.deregister()

        try:
            await asyncio.wait_for(goodbye(), timeout)
        except asyncio.TimeoutError:
            logger.warning("shutdown: the metaserver did not answer within %.1fs", timeout)
        finally:
            await self._meta.aclose()

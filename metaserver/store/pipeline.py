"""Auto-pipelining of the Redis store's script calls (`Pipeliner`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

__all__ = ["NotReplicated", "Pipeliner"]


class NotReplicated(RedisError):
    """Fewer replicas than asked confirmed a write in time (the store answers 503)."""


class Pipeliner:
    """Auto-pipelining: script calls made while others are being prepared go to Redis as one pipeline.

    Why: at high concurrency most of a call's cost is redis-py's per-command overhead, not Redis. Calls
    queued in one event-loop turn are sent together (one write, one read pass) and answered in order;
    a lone call goes alone. Each call is still one atomic EVALSHA; only the transport is shared. A script
    missing on the server (NOSCRIPT, e.g. a restarted Redis) is loaded and its call retried alone.

    `wait=(replicas, timeout_ms)` ends every batch with `WAIT replicas timeout_ms` on the same connection
    (still one round trip): a caller hears of its write only once that many replicas hold it, so a
    failover to one of them cannot undo an answer already given. When fewer confirm in time, every call of
    the batch fails with `NotReplicated` (a 503: the write is on the master, but may not survive it), as
    Redis's own `min-replicas-to-write` refuses writes. One Redis or a Sentinel-managed master only: WAIT
    names no key, so a cluster could not route it.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ready: Callable[[], Awaitable[None]] | None = None,
        wait: tuple[int, int] | None = None,
    ) -> None:
        """`ready` is awaited before each send (the Redis store uses it to set up a cluster client once)."""
        self._client = client
        self._ready = ready
        self._wait = wait
        self._pending: list[tuple[AsyncScript, list[Any], list[Any], asyncio.Future[Any]]] = []
        self._scheduled = False
        self._sending: set[asyncio.Future[None]] = set()

    def call(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)  # a reference until done, so the task is not collected mid-flight
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[AsyncScript, list[Any], list[Any], asyncio.Future[Any]]]) -> None:
        if self._ready is not None:
            try:
                await self._ready()
            except BaseException as exc:
                for *_, fut in batch:
                    _settle(fut, exc)
                return
        if len(batch) == 1 and self._wait is None:
            script, keys, args, fut = batch[0]
            try:
                result: Any = await script(keys=keys, args=args)
            except BaseException as exc:  # handed to the caller, who maps it
                result = exc
            _settle(fut, result)
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in batch:
                    # execute_command, not pipe.evalsha: redis-py's cluster pipeline refuses the method
                    # (it cannot know the keys' slots in general); the command itself routes by KEYS.
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                if self._wait is not None:
                    pipe.execute_command("WAIT", *self._wait)
                results = await pipe.execute(raise_on_error=False)
            if self._wait is not None:
                acked, results = results[-1], results[:-1]
                if not isinstance(acked, int) or acked < self._wait[0]:
                    short = NotReplicated(f"{acked} of {self._wait[0]} replicas confirmed in {self._wait[1]} ms")
                    for *_, fut in batch:
                        _settle(fut, short)
                    return
        except BaseException as exc:
            for *_, fut in batch:
                _settle(fut, exc)
            return
        for (script, keys, args, fut), result in zip(batch, results, strict=True):
            if isinstance(result, NoScriptError):
                try:
                    result = await self._again(script, keys, args)
                except BaseException as exc:
                    result = exc
            _settle(fut, result)

    async def _again(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """A call the server lacked the script for: EVAL with the source (which loads it), then WAIT on
        the same connection when asked to."""
        if self._wait is None:
            return await script(keys=keys, args=args)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
            pipe.execute_command("WAIT", *self._wait)
            result, acked = await pipe.execute()
        if acked < self._wait[0]:
            raise NotReplicated(f"{acked} of {self._wait[0]} replicas confirmed in {self._wait[1]} ms")
        return result


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():  # the caller gave up (cancelled)
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)

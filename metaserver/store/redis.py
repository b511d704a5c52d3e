"""RedisStore: the production store; several metaserver replicas on one Redis behave as one.

Why Lua: every handoff transition is one EVALSHA of a script in `store/lua/` that checks the state and
writes the record, its deadline and (on terminal moves) the prefill's event stream atomically, so
concurrent claimers on different replicas see exactly one winner and a sweeper on every replica can
run at once. Scripts are registered once per client (redis-py `Script`: EVALSHA, reloaded on NOSCRIPT,
so a restarted Redis needs no restart of ours). Keys come only from `store/keys.py`; the store's
constants (prefixes, TTLs, bounds) are written into the scripts when they are registered, so a call
sends only what changes. Concurrent calls share round trips (`_Pipeliner`: auto-pipelining).

Long-polls: `wait_handoff` listens on one pub/sub channel (one subscriber per store, shared by all
waiters) and re-reads every 0.5 s in case a message was lost; `read_events` uses XREAD BLOCK on a
separate connection pool without a socket timeout. Connection errors become `StoreUnavailable` (503);
redis-py reconnects by itself once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from pdgate.metaserver import ledger
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound, StoreFailure, StoreUnavailable
from pdgate.metaserver.guards import check_cursor
from pdgate.metaserver.models import (
    Handoff,
    HandoffCreate,
    HandoffEvent,
    HandoffEvents,
    HandoffState,
    Instance,
    InstanceLoad,
    InstanceState,
    KVLocation,
)
from pdgate.metaserver.store.base import LIVE_STATES, LedgerPolicy, Moved, Store
from pdgate.metaserver.store.keys import DEFAULT_PREFIX, INSTANCE_TTL_GRACE_S, Keys, ttl_ms
from pdgate.metaserver.store.memory import kv_key_seed
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")
S = HandoffState

_SCRIPTS = ("create", "ready", "claim", "done", "abort", "expire", "register", "heartbeat", "drain")
_HANDOFF_SCRIPTS = frozenset({"create", "ready", "claim", "done", "abort", "expire"})
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)
_BLOCKING_MARGIN_S = 2.0


def _csv(states: frozenset[HandoffState]) -> str:
    return "," + ",".join(sorted(s.value for s in states)) + ","


_FROM = {op: _csv(states) for op, states in ledger.OPERATIONS.items()}


def _lua_string(value: str) -> str:
    if not all(c.isalnum() or c in "{}._:-" for c in value):
        raise ValueError(f"unexpected character in {value!r}")  # keys.py keeps prefixes to these
    return "'" + value + "'"


def _load_script(name: str, cfg: dict[str, str | int]) -> str:
    """A script's source: handoff scripts get `local CFG = {...}` (this store's constants) and _lib.lua."""
    lua = resources.files("pdgate.metaserver.store").joinpath("lua")
    src = lua.joinpath(f"{name}.lua").read_text()
    if name in _HANDOFF_SCRIPTS:
        fields = ", ".join(f"{k} = {_lua_string(v) if isinstance(v, str) else int(v)}" for k, v in cfg.items())
        src = f"local CFG = {{{fields}}}\n" + lua.joinpath("_lib.lua").read_text() + "\n" + src
    return src


def _split_url(url: str) -> tuple[str, str]:
    """Our own `prefix` query parameter is taken out; the rest goes to redis-py as it is."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = DEFAULT_PREFIX
    rest = []
    for k, v in query:
        if k == "prefix":
            prefix = v
        else:
            rest.append((k, v))
    return urlunsplit(parts._replace(query=urlencode(rest))), prefix


def _pairs(flat: list[Any]) -> dict[str, str]:
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def _handoff(d: dict[str, str]) -> Handoff:
    loc = d.get("location")
    deadline = d.get("deadline")
    return Handoff.model_validate(
        {
            "transfer_id": d["transfer_id"],
            "kv_key": int(d["kv_key"]),
            "state": d["state"],
            "prefill_instance_id": d["prefill_instance_id"],
            "decode_instance_id": d.get("decode_instance_id") or None,
            "location": orjson.loads(loc) if loc else None,
            "request_id": d.get("request_id") or None,
            "reason": d.get("reason") or None,
            "created_at": float(d["created_at"]),
            "updated_at": float(d["updated_at"]),
            "deadline": float(deadline) if deadline else None,
            "lease_s": float(d["lease_s"]),
            "claims": int(d.get("claims", 0)),
        }
    )


def _instance(d: dict[str, str]) -> Instance:
    data = orjson.loads(d["doc"])
    data.update(
        lease_s=float(d["lease_s"]),
        registered_at=float(d["registered_at"]),
        last_heartbeat=float(d["last_heartbeat"]),
        state=d["state"],
        load=orjson.loads(d["load"]),
    )
    return Instance.model_validate(data)


def _live(d: dict[str, str], now: float) -> bool:
    return bool(d) and float(d["last_heartbeat"]) + float(d["lease_s"]) >= now


class _Pipeliner:
    """Auto-pipelining: script calls made while others are being prepared go to Redis as one pipeline.

    Why: at high concurrency most of a call's cost is redis-py's per-command overhead, not Redis. Calls
    queued in one event-loop turn are sent together (one write, one read pass) and answered in order;
    a lone call goes alone. Each call is still one atomic EVALSHA; only the transport is shared. A script
    missing on the server (NOSCRIPT, e.g. a restarted Redis) is loaded and its call retried alone.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
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
        if len(batch) == 1:
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
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for *_, fut in batch:
                _settle(fut, exc)
            return
        for (script, keys, args, fut), result in zip(batch, results, strict=True):
            if isinstance(result, NoScriptError):
                try:
                    result = await script(keys=keys, args=args)  # loads the script, then EVALSHA again
                except BaseException as exc:
                    result = exc
            _settle(fut, result)


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():  # the caller gave up (cancelled)
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


class RedisStore(Store):
    def __init__(self, url: str, *, policy: LedgerPolicy | None = None) -> None:
        self.url = url
        self.policy = policy or LedgerPolicy()
        redis_url, prefix = _split_url(url)
        self.keys = Keys(prefix)
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": 1.0,
            # One quick reconnect covers a pooled connection that died with a restarted Redis; a Redis
            # that stays down answers 503 at once instead of after a long backoff.
            "retry": Retry(ConstantBackoff(0.02), 1),
            "retry_on_error": [RedisConnectionError],
        }
        # Connections are made on demand and reused (up to one per concurrent request; `max_connections=N` in
        # the URL caps them). Blocking reads (XREAD BLOCK, pub/sub) hold theirs for the whole wait: own
        # pool, no socket timeout (the block time bounds them).
        self._redis = aioredis.Redis.from_url(redis_url, max_connections=4096, socket_timeout=5.0, **common)
        self._blocking = aioredis.Redis.from_url(redis_url, max_connections=4096, socket_timeout=None, **common)
        p = self.policy
        cfg: dict[str, str | int] = {
            "events_prefix": self.keys.events_prefix,
            "handoff_prefix": self.keys.handoff_prefix,
            "left_pending": self.keys.left_pending,
            "terminal_ttl_ms": ttl_ms(p.terminal_ttl_s),
            "events_maxlen": p.events_maxlen,
            "events_ttl_s": max(1, int(p.events_ttl_s)),
            "max_claims": p.max_claims,
            "state_counts": self.keys.state_counts,
        }
        # Registered once per client; redis-py's Script runs EVALSHA and reloads on NOSCRIPT (a restarted Redis).
        self._scripts = {name: self._redis.register_script(_load_script(name, cfg)) for name in _SCRIPTS}
        self._pipeliner = _Pipeliner(self._redis)
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._closing = False

    # -- plumbing ----------------------------------------------------------------------------
    async def _guard(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store unavailable: {exc}") from exc
        except RedisError as exc:
            raise StoreFailure(f"redis store error: {exc}") from exc

    def _common(self, now: float, transfer_id: str) -> list[Any]:
        return [repr(now), transfer_id]

    async def _move(self, script: str, transfer_id: str, to: HandoffState, now: float, *extra: Any) -> Moved:
        args = [*self._common(now, transfer_id), _FROM[script], *extra]
        keys = [self.keys.deadlines, self.keys.handoff(transfer_id)]
        res = await self._guard(self._pipeliner.call(self._scripts[script], keys, args))
        status = res[0]
        if status == "ok":
            return Moved(S(res[1]), _handoff(_pairs(res[2:])))
        if status == "missing":
            raise HandoffNotFound(f"handoff {transfer_id} not found")
        current = S(res[1])
        detail = None
        if len(res) > 2:
            detail = f"handoff already claimed by {res[2]}" if to is S.CLAIMED else f"handoff is claimed by {res[2]}"
        raise ledger.IllegalTransition(current, to, detail)

    # -- lifecycle ---------------------------------------------------------------------------
    async def ping(self) -> None:
        await self._guard(self._redis.ping())

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except (asyncio.CancelledError, Exception):
                pass
        await self._redis.aclose(close_connection_pool=True)
        await self._blocking.aclose(close_connection_pool=True)

    # -- registry ----------------------------------------------------------------------------
    async def register(self, inst: Instance, *, now: float) -> Instance:
        doc = inst.model_dump_json(exclude={"lease_s", "registered_at", "last_heartbeat", "state", "load"})
        keys = [self.keys.instance(inst.id), self.keys.instances]
        args = [
            repr(now),
            inst.id,
            doc,
            repr(inst.lease_s),
            inst.load.model_dump_json(),
            repr(now + inst.lease_s),
            self.keys.instance_ttl_ms(inst.lease_s),
        ]
        registered_at, state = await self._guard(self._scripts["register"](keys=keys, args=args))
        return inst.model_copy(update={"registered_at": float(registered_at), "state": InstanceState(state)})

    async def heartbeat(self, instance_id: str, load: InstanceLoad | None, *, now: float) -> Instance | None:
        keys = [self.keys.instance(instance_id), self.keys.instances]
        args = [repr(now), instance_id, load.model_dump_json() if load is not None else "", INSTANCE_TTL_GRACE_S]
        res = await self._guard(self._scripts["heartbeat"](keys=keys, args=args))
        return _instance(_pairs(res)) if res else None

    async def drain(self, instance_id: str, *, now: float) -> Instance | None:
        res = await self._guard(self._scripts["drain"](keys=[self.keys.instance(instance_id)], args=[repr(now)]))
        return _instance(_pairs(res)) if res else None

    async def deregister(self, instance_id: str) -> bool:
        async def op() -> bool:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.keys.instance(instance_id))
                pipe.zrem(self.keys.instances, instance_id)
                deleted, _ = await pipe.execute()
            return bool(deleted)

        return await self._guard(op())

    async def get_instance(self, instance_id: str, *, now: float) -> Instance | None:
        d = await self._guard(self._redis.hgetall(self.keys.instance(instance_id)))
        return _instance(d) if _live(d, now) else None

    async def list_instances(self, *, now: float) -> list[Instance]:
        async def op() -> list[dict[str, str]]:
            ids = await self._redis.zrangebyscore(self.keys.instances, repr(now), "+inf")
            async with self._redis.pipeline(transaction=False) as pipe:
                # Prune on read: entries whose lease lapsed (their hash expires by its own TTL).
                pipe.zremrangebyscore(self.keys.instances, "-inf", f"({now!r}")
                for iid in ids:
                    pipe.hgetall(self.keys.instance(iid))
                res = await pipe.execute()
            return list(res[1:])

        found = await self._guard(op())
        return sorted((_instance(d) for d in found if _live(d, now)), key=lambda i: i.id)

    async def count_instances(self, *, now: float) -> int:
        return int(await self._guard(self._redis.zcount(self.keys.instances, repr(now), "+inf")))

    # -- ledger ------------------------------------------------------------------------------
    async def create_handoff(
        self, body: HandoffCreate, *, transfer_id: str, now: float, pending_lease_s: float, ready_lease_s: float
    ) -> Handoff:
        ready_lease = body.lease_s if body.lease_s is not None else ready_lease_s
        deadline = now + pending_lease_s
        args = [
            *self._common(now, transfer_id),
            kv_key_seed(time.time()),
            body.prefill_instance_id,
            body.request_id or "",
            repr(deadline),
            repr(ready_lease),
        ]
        keys = [self.keys.deadlines, self.keys.handoff(transfer_id), self.keys.kv_counter]
        res = await self._guard(self._pipeliner.call(self._scripts["create"], keys, args))
        if res[0] == "exists":
            raise HandoffExists(f"handoff {transfer_id} already exists", current_state=S(res[1]))
        return ledger.create(
            body,
            transfer_id=transfer_id,
            kv_key=int(res[1]),
            now=now,
            pending_lease_s=pending_lease_s,
            ready_lease_s=ready_lease_s,
        )

    async def get_handoff(self, transfer_id: str) -> Handoff | None:
        d = await self._guard(self._redis.hgetall(self.keys.handoff(transfer_id)))
        return _handoff(d) if d else None

    async def mark_ready(self, transfer_id: str, location: KVLocation, *, now: float) -> Moved:
        return await self._move("ready", transfer_id, S.READY, now, location.model_dump_json())

    async def claim(self, transfer_id: str, decode_instance_id: str, *, now: float, lease_s: float) -> Moved:
        return await self._move("claim", transfer_id, S.CLAIMED, now, decode_instance_id, repr(lease_s))

    async def done(self, transfer_id: str, decode_instance_id: str | None, *, now: float) -> Moved:
        return await self._move("done", transfer_id, S.DONE, now, decode_instance_id or "")

    async def abort(self, transfer_id: str, reason: str, *, now: float) -> Moved:
        return await self._move("abort", transfer_id, S.ABORTED, now, reason)

    async def expire_due(self, *, now: float, limit: int = 1000) -> list[Moved]:
        args = [*self._common(now, ""), limit, _FROM["expire"]]
        res = await self._guard(self._scripts["expire"](keys=[self.keys.deadlines], args=args))
        return [Moved(S(r[0]), _handoff(_pairs(r[1:]))) for r in res]

    async def count_handoffs_by_state(self) -> dict[HandoffState, int]:
        raw = await self._guard(self._redis.hgetall(self.keys.state_counts))
        # max(0, ...): data written before the counters existed could drive one below zero; never report that.
        return {state: max(0, int(raw.get(state.value, 0))) for state in LIVE_STATES}

    # -- long-polls --------------------------------------------------------------------------
    def _ensure_listener(self) -> None:
        if not self._closing and (self._listener is None or self._listener.done()):
            self._listener = asyncio.create_task(self._listen(), name="pdgate-left-pending")

    async def _listen(self) -> None:
        """Wake the waiters of each transfer id published on the left-pending channel; survive outages.

        Ends on `_closing` too: redis-py may turn a cancellation inside a read into a connection error."""
        while not self._closing:
            pubsub = self._blocking.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.left_pending)
                while not self._closing:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        for event in self._waiters.get(msg["data"], ()):
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the waiters fall back to re-reading; try again shortly
                log.debug("left-pending listener: %r; resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    async def wait_handoff(self, transfer_id: str, *, timeout: float) -> Handoff | None:
        rec = await self.get_handoff(transfer_id)
        if rec is None or rec.state is not S.PENDING or timeout <= 0:
            return rec
        self._ensure_listener()
        event = asyncio.Event()
        self._waiters.setdefault(transfer_id, set()).add(event)
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        try:
            while True:
                rec = await self.get_handoff(transfer_id)
                remaining = until - loop.time()
                if rec is None or rec.state is not S.PENDING or remaining <= 0:
                    return rec
                try:
                    await asyncio.wait_for(event.wait(), min(remaining, 0.5))
                except asyncio.TimeoutError:
                    pass
                event.clear()
        finally:
            waiting = self._waiters.get(transfer_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[transfer_id]

    async def read_events(
        self, instance_id: str, cursor: str | None, *, wait: float, limit: int = 1000
    ) -> HandoffEvents:
        after = check_cursor(cursor) or "0"  # one grammar for both stores
        key = self.keys.events(instance_id)
        if wait > 0:
            call: Callable[[], Awaitable[Any]] = lambda: self._blocking.xread(  # noqa: E731
                {key: after}, count=limit, block=max(1, int(wait * 1000))
            )
        else:
            call = lambda: self._redis.xread({key: after}, count=limit)  # noqa: E731
        try:
            # The blocking pool has no socket timeout (the BLOCK time bounds a healthy read); a frozen
            # Redis must not hold the poll (and its connection) longer than the wait plus a margin.
            res = await asyncio.wait_for(self._guard(call()), wait + _BLOCKING_MARGIN_S)
        except TimeoutError:
            raise StoreUnavailable(f"redis store did not answer a {wait:g} s read in time") from None
        events: list[HandoffEvent] = []
        last = after
        for _stream, entries in res or ():
            for entry_id, f in entries:
                events.append(
                    HandoffEvent(
                        transfer_id=f["transfer_id"],
                        kv_key=int(f["kv_key"]),
                        state=S(f["state"]),
                        reason=f.get("reason") or None,
                        at=float(f["at"]),
                    )
                )
                last = entry_id
        return HandoffEvents(events=events, cursor=last)

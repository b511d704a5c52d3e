"""RedisStore: the production store; several metaserver replicas on one Redis (plain, Sentinel-managed
or a Cluster, see `redis_urls.py`) behave as one.

Why Lua: every handoff transition is one EVALSHA of a script in `store/lua/` that checks the state and
writes the record, its deadline and (on terminal moves) the prefill's event stream atomically, so
concurrent claimers on different replicas see exactly one winner and a sweeper on every replica can
run at once. The scripts decide nothing of their own: they interpret the rows of `ledger.MOVES`, which
`store/scripts.py` loads into them with this store's constants (see `ledger.py` for why a table and not
a read followed by a compare-and-set). Keys come only from `store/keys.py`. Concurrent calls share
round trips (`pipeline.Pipeliner`: auto-pipelining).

Long-polls: `wait_handoff` is woken by the left-pending announcements (`wakeups.py`: one subscriber per
store, shared by all waiters) and re-reads every 0.5 s in case a message was lost; `read_events` uses XREAD BLOCK on a
separate connection pool without a socket timeout. Connection errors become `StoreUnavailable` (503);
redis-py reconnects by itself once Redis is back (with Sentinel: to whichever master the Sentinels name).

On a Redis Cluster the ledger is sharded by prefill (`keys.py`); a move names only the transfer id, so
its shard comes from a locator written before the record (`shards.Locator`). The sweeper and the
per-state counts visit every shard in one pipeline, which redis-py splits by node.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from functools import partial
from typing import Any, TypeVar, cast

import orjson
import redis.asyncio as aioredis
from pdgate.metaserver import ledger, registry
from pdgate.metaserver.errors import HandoffExists, HandoffNotFound, StoreFailure, StoreUnavailable
from pdgate.metaserver.guards import check_cursor
from pdgate.metaserver.store import wakeups
from pdgate.metaserver.store.base import LIVE_STATES, LedgerPolicy, Moved, Store
from pdgate.metaserver.store.keys import INSTANCE_TTL_GRACE_S, Keys, ShardKeys
from pdgate.metaserver.store.pipeline import NotReplicated, Pipeliner
from pdgate.metaserver.store.redis_urls import connect, parse_store_url
from pdgate.metaserver.store.scripts import load_scripts
from pdgate.metaserver.store.shards import Locator, xread
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterError, RedisClusterException, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdgate.meta_client import MetaError
from pdgate.models import (
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

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")
S = HandoffState

# redis-py's failures -> the store error a caller sees (first match wins): the store boundary's one table.
# A cluster that is down, a slot not served, a multi-key call caught mid-migration (TRYAGAIN) or a write
# too few replicas confirmed (`wait_replicas`) is as unavailable as a server that does not answer: the
# caller may retry.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterError,  # a cluster down, or redirections/TRYAGAIN that did not settle ("TTL exhausted")
    TryAgainError,
    RedisClusterException,
    NotReplicated,
)
_REDIS_ERRORS: tuple[tuple[tuple[type[Exception], ...], type[MetaError], str], ...] = (
    (_UNAVAILABLE, StoreUnavailable, "redis store unavailable"),
    ((RedisError,), StoreFailure, "redis store error"),
)
_BLOCKING_MARGIN_S = 2.0


def _split_url(url: str) -> tuple[str, str]:
    """Our own `prefix` query parameter is taken out; the rest goes to redis-py as it is."""
    target = parse_store_url(url)
    return target.url, target.prefix


_Args = list[str | int | float]


def _pairs(flat: list[Any]) -> dict[str, str]:
    it = iter(flat)
    return dict(zip(it, it, strict=False))


_PAGE = 500  # list_live_handoffs: transfer ids read per page of a shard's deadlines
_SCAN_CAP = 20_000  # and at most this many per shard


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


def _arg(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _live_instance(d: dict[str, str], now: float) -> Instance | None:
    """The record read, if there is one and `registry.is_live` says it counts."""
    if not d:
        return None
    inst = _instance(d)
    return inst if registry.is_live(inst, now) else None


class RedisStore(Store):
    def __init__(self, url: str, *, policy: LedgerPolicy | None = None) -> None:
        self.url = url
        self.policy = policy or LedgerPolicy()
        target = parse_store_url(url)
        self.keys = Keys(target.prefix, buckets=target.buckets)
        # Connections are made on demand and reused (up to one per concurrent request; `max_connections=N` in
        # the URL caps them). Blocking reads (XREAD BLOCK, pub/sub) hold theirs for the whole wait: own
        # pool, no socket timeout (the block time bounds them).
        self._redis = connect(target, socket_timeout=5.0, max_connections=4096)
        self._blocking = connect(target, socket_timeout=None, max_connections=4096)
        # A cluster client registers scripts the same way (EVALSHA routes by KEYS, NOSCRIPT reloads).
        self._scripts = load_scripts(cast(aioredis.Redis, self._redis), self.keys, self.policy)
        self._cluster_ready = not isinstance(self._redis, RedisCluster)
        self._cluster_lock = asyncio.Lock()
        ready = None if self._cluster_ready else self._init_cluster
        wait = (target.wait_replicas, target.wait_timeout_ms) if target.wait_replicas else None
        self._pipeliner = Pipeliner(cast(aioredis.Redis, self._redis), ready=ready, wait=wait)
        self._locator = Locator(self.keys, self._redis, self.policy.terminal_ttl_s)
        self._closing = False
        self._wakeups = wakeups.Wakeups(self._blocking, self.keys, lambda: self._closing)

    # -- plumbing ----------------------------------------------------------------------------
    async def _init_cluster(self) -> None:
        """Learn the cluster's slot map once, before the first command: redis-py's cluster client breaks
        connections when many first commands race to initialise it."""
        if self._cluster_ready:
            return
        async with self._cluster_lock:
            if not self._cluster_ready:
                for client in (self._redis, self._blocking):
                    await cast(RedisCluster, client).initialize()
                self._cluster_ready = True

    async def _guard(self, op: Awaitable[T]) -> T:
        try:
            if not self._cluster_ready:
                try:
                    await self._init_cluster()
                except BaseException:
                    if inspect.iscoroutine(op):
                        op.close()  # never started: no "never awaited" warning
                    raise
            return await op
        except (RedisError, RedisClusterException) as exc:
            for kinds, error, what in _REDIS_ERRORS:
                if isinstance(exc, kinds):
                    raise error(f"{what}: {exc}") from exc
            raise
        except OSError as exc:
            raise StoreUnavailable(f"redis store unavailable: {exc}") from exc

    async def _hash(self, key: str) -> dict[str, str]:
        return cast(dict[str, str], await self._guard(self._redis.hgetall(key)))

    async def _move(
        self,
        name: str,
        transfer_id: str,
        now: float,
        *,
        caller: str | None = None,
        value: str = "",
        lease: str = "",
        ready_check: tuple[str, str, str] | None = None,
    ) -> Moved:
        """One row of `ledger.MOVES`, applied by `move.lua`; its refusals are `ledger.refused`'s, and
        with `ready_check` (one Redis only: `mark_ready`) `ledger.check_ready`'s."""
        shard = await self._shard(transfer_id)
        if shard is None:
            raise HandoffNotFound(f"handoff {transfer_id} not found")
        args: _Args = [repr(now), transfer_id, name, caller or "", value, lease, *(ready_check or ())]
        keys = [shard.deadlines, shard.handoff(transfer_id)]
        res = await self._guard(self._pipeliner.call(self._scripts["move"], keys, args))
        if res[0] == "ok":
            return Moved(S(res[1]), _handoff(_pairs(res[2:])))
        if res[0] == "missing":
            raise HandoffNotFound(f"handoff {transfer_id} not found")
        if res[0] == "not_its_prefill":  # {'not_its_prefill', rule, prefill, registered}: _lib.lua's check_ready
            raise ledger.NotItsPrefill(res[1], res[2], res[3] if res[1] == "engine_id" else None)
        claimant = res[2] if len(res) > 2 else None
        raise ledger.refused(ledger.MOVES[name], S(res[1]), claimant=claimant, caller=caller)

    async def _shard(self, transfer_id: str) -> ShardKeys | None:
        return await self._guard(self._locator.find(transfer_id))

    async def _each_shard(self, script: str, args: _Args) -> list[Any]:
        """One script call per shard, sent together (one pipeline, split by node on a cluster)."""
        calls = [self._pipeliner.call(self._scripts[script], [shard.deadlines], args) for shard in self.keys.shards]
        return list(await self._guard(asyncio.gather(*calls)))

    # -- lifecycle ---------------------------------------------------------------------------
    async def ping(self) -> None:
        await self._guard(self._redis.ping())

    async def close(self) -> None:
        self._closing = True
        await self._wakeups.close()
        for client in (self._redis, self._blocking):
            if isinstance(client, aioredis.Redis):
                await client.aclose(close_connection_pool=True)
            else:
                await client.aclose()

    # -- registry ----------------------------------------------------------------------------
    async def register(self, inst: Instance, *, now: float) -> Instance:
        doc = inst.model_dump_json(exclude={"lease_s", "registered_at", "last_heartbeat", "state", "load"})
        keys = [self.keys.instance(inst.id), self.keys.instances]
        fresh = inst.model_dump(mode="json", include=set(registry.KEPT_ON_REREGISTER))
        args: _Args = [
            repr(now),
            inst.id,
            doc,
            repr(inst.lease_s),
            inst.load.model_dump_json(),
            repr(now + inst.lease_s),
            self.keys.instance_ttl_ms(inst.lease_s),
            *(_arg(fresh[name]) for name in registry.KEPT_ON_REREGISTER),
        ]
        kept = await self._guard(self._scripts["register"](keys=keys, args=args))
        data = inst.model_dump(mode="json")
        data.update(zip(registry.KEPT_ON_REREGISTER, kept, strict=True))
        return Instance.model_validate(data)

    async def heartbeat(self, instance_id: str, load: InstanceLoad | None, *, now: float) -> Instance | None:
        keys = [self.keys.instance(instance_id), self.keys.instances]
        args: _Args = [repr(now), instance_id, load.model_dump_json() if load is not None else "", INSTANCE_TTL_GRACE_S]
        res = await self._guard(self._scripts["heartbeat"](keys=keys, args=args))
        return _instance(_pairs(res)) if res else None

    async def drain(
        self, instance_id: str, *, now: float, state: InstanceState = InstanceState.DRAINING
    ) -> Instance | None:
        args = [repr(now), state.value]
        res = await self._guard(self._scripts["drain"](keys=[self.keys.instance(instance_id)], args=args))
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
        return _live_instance(await self._hash(self.keys.instance(instance_id)), now)

    async def list_instances(self, *, now: float) -> list[Instance]:
        async def op() -> list[dict[str, str]]:
            ids = cast(list[str], await self._redis.zrangebyscore(self.keys.instances, repr(now), "+inf"))
            async with self._redis.pipeline(transaction=False) as pipe:
                # Prune on read: entries whose lease lapsed (their hash expires by its own TTL).
                pipe.zremrangebyscore(self.keys.instances, "-inf", f"({now!r}")
                for iid in ids:
                    pipe.hgetall(self.keys.instance(iid))
                res = await pipe.execute()
            return list(res[1:])

        found = await self._guard(op())
        live = (_live_instance(d, now) for d in found)
        return sorted((i for i in live if i is not None), key=lambda i: i.id)

    async def count_instances(self, *, now: float) -> int:
        return int(await self._guard(self._redis.zcount(self.keys.instances, repr(now), "+inf")))

    # -- ledger ------------------------------------------------------------------------------
    async def create_handoff(
        self, body: HandoffCreate, *, transfer_id: str, now: float, pending_lease_s: float, ready_lease_s: float
    ) -> Handoff:
        # The record as ledger.create decides it; only its kv_key comes from the script (1 until then).
        leases = {"pending_lease_s": pending_lease_s, "ready_lease_s": ready_lease_s}
        rec = ledger.create(body, transfer_id=transfer_id, kv_key=1, now=now, **leases)
        assert rec.deadline is not None
        shard = self.keys.shard_of(rec.prefill_instance_id)
        if self.keys.sharded and not await self._guard(self._locator.claim(transfer_id, shard.bucket)):
            found = await self.get_handoff(transfer_id)  # the id is another prefill's handoff
            state = found.state if found is not None else S.PENDING
            raise HandoffExists(f"handoff {transfer_id} already exists", current_state=state)
        args = [
            repr(now),
            transfer_id,
            shard.bucket,
            rec.prefill_instance_id,
            rec.request_id or "",
            repr(rec.deadline),
            repr(rec.lease_s),
        ]
        keys = [shard.deadlines, shard.handoff(transfer_id), shard.kv_counter]
        res = await self._guard(self._pipeliner.call(self._scripts["create"], keys, args))
        if res[0] == "exists":
            raise HandoffExists(f"handoff {transfer_id} already exists", current_state=S(res[1]))
        return rec.model_copy(update={"kv_key": int(res[1])})

    async def get_handoff(self, transfer_id: str) -> Handoff | None:
        shard = await self._shard(transfer_id)
        d = await self._hash(shard.handoff(transfer_id)) if shard is not None else None
        return _handoff(d) if d else None

    async def mark_ready(
        self, transfer_id: str, location: KVLocation, *, now: float, engine: str | None = None
    ) -> Moved:
        value = location.model_dump_json()
        if engine is None and location.engine_id is None:
            return await self._move("ready", transfer_id, now, value=value)
        if self.keys.sharded:
            # A sharded ledger (Redis Cluster, buckets > 1): the registry (`{PREFIX}:i:<id>`) is in another
            # slot than the record's shard `{PREFIX:N}`, so move.lua may not read it; check with two reads
            # first (a check, then the move: not one atomic step), then move unchecked.
            await self._check_ready_by_reads(transfer_id, location, engine, now)
            return await self._move("ready", transfer_id, now, value=value)
        # One shard (one Redis, plain or Sentinel; a Cluster with buckets=1): the registry shares its hash
        # tag `{PREFIX}` (keys.py), so move.lua checks in the move's own step, no round trip added.
        # ARGV[7..9]: _lib.lua's check_ready.
        engine_id = ("1", location.engine_id) if location.engine_id is not None else ("0", "")
        return await self._move("ready", transfer_id, now, value=value, ready_check=(engine or "", *engine_id))

    async def _check_ready_by_reads(
        self, transfer_id: str, location: KVLocation, engine: str | None, now: float
    ) -> None:
        rec = await self.get_handoff(transfer_id)
        if rec is None:
            return  # the move answers 404
        prefill = rec.prefill_instance_id
        inst = await self.get_instance(prefill, now=now) if location.engine_id is not None else None
        registered = inst.engine_id if inst is not None else None
        ledger.check_ready(prefill, engine=engine, engine_id=location.engine_id, registered=registered)

    async def claim(self, transfer_id: str, decode_instance_id: str, *, now: float, lease_s: float) -> Moved:
        return await self._move("claim", transfer_id, now, caller=decode_instance_id, lease=repr(lease_s))

    async def done(self, transfer_id: str, decode_instance_id: str | None, *, now: float) -> Moved:
        return await self._move("done", transfer_id, now, caller=decode_instance_id)

    async def abort(self, transfer_id: str, reason: str, *, now: float) -> Moved:
        return await self._move("abort", transfer_id, now, value=reason)

    async def expire_due(self, *, now: float, limit: int = 1000) -> list[Moved]:
        # Each shard moves at most `limit`: a caller that got fewer than `limit` in all has drained them all.
        args: _Args = [repr(now), "", limit]
        res = await self._each_shard("expire", args)
        return [Moved(S(r[0]), _handoff(_pairs(r[1:]))) for shard_res in res for r in shard_res]

    async def list_live_handoffs(self, *, state: HandoffState | None, limit: int) -> list[Handoff]:
        """Each shard's deadlines zset (its live handoffs by lease end), read in pages of `_PAGE` until
        `limit` match or `_SCAN_CAP` were read: an operator's view, bounded, never a full scan."""

        async def op() -> list[Handoff]:
            found: list[Handoff] = []
            for shard in self.keys.shards:
                start = 0
                while start < _SCAN_CAP and sum(1 for h in found if state in (None, h.state)) < limit:
                    tids = cast(list[str], await self._redis.zrange(shard.deadlines, start, start + _PAGE - 1))
                    if not tids:
                        break
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for tid in tids:
                            pipe.hgetall(shard.handoff(tid))
                        rows = await pipe.execute()
                    found += [_handoff(r) for r in rows if r]
                    start += _PAGE
            live = [h for h in found if h.state in LIVE_STATES and state in (None, h.state)]
            return sorted(live, key=lambda h: (h.deadline or 0.0, h.transfer_id))[:limit]

        return await self._guard(op())

    async def count_handoffs_by_state(self) -> dict[HandoffState, int]:
        async def op() -> list[dict[str, str]]:
            if not self.keys.sharded:
                return [cast(dict[str, str], await self._redis.hgetall(self.keys.state_counts))]
            async with self._redis.pipeline(transaction=False) as pipe:
                for shard in self.keys.shards:
                    pipe.hgetall(shard.state_counts)
                return list(await pipe.execute())

        raws = await self._guard(op())
        # max(0, ...): a hand-edited or partly flushed key could drive a counter below zero; never report that.
        return {state: sum(max(0, int(raw.get(state.value, 0))) for raw in raws) for state in LIVE_STATES}

    # -- long-polls --------------------------------------------------------------------------
    async def wait_handoff(self, transfer_id: str, *, timeout: float) -> Handoff | None:
        rec = await self.get_handoff(transfer_id)
        if rec is None or rec.state is not S.PENDING or timeout <= 0:
            return rec
        event = self._wakeups.watch(transfer_id)
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        try:
            while True:
                rec = await self.get_handoff(transfer_id)
                remaining = until - loop.time()
                if rec is None or rec.state is not S.PENDING or remaining <= 0:
                    return rec
                try:
                    await asyncio.wait_for(event.wait(), min(remaining, wakeups.RECHECK_S))
                except asyncio.TimeoutError:
                    pass
                event.clear()
        finally:
            self._wakeups.unwatch(transfer_id, event)

    async def read_events(
        self, instance_id: str, cursor: str | None, *, wait: float, limit: int = 1000
    ) -> HandoffEvents:
        after = check_cursor(cursor) or "0"  # one grammar for both stores
        key = self.keys.events(instance_id)
        block = max(1, int(wait * 1000)) if wait > 0 else None
        call = partial(xread, self._blocking if wait > 0 else self._redis, key, after, limit, block)
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

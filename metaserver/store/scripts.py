"""The Redis store's Lua scripts, each loaded with the store's constants and the ledger's table.

Why the table travels as data: the transition rules live once, in `ledger.MOVES` (and the registry's
`KEPT_ON_REREGISTER`); `_lib.lua` interprets them. Every script is loaded as `local CFG = {...}` (this
store's key prefixes, retention bounds and those tables, rendered as a Lua table literal), then
`_lib.lua`, then the script itself, so a call sends only what changes. Scripts are registered once per
client: redis-py's `Script` runs EVALSHA and reloads a script a restarted Redis lost.
"""

from __future__ import annotations

from enum import Enum
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from pdgate.metaserver import ledger, registry
from pdgate.metaserver.store.base import LedgerPolicy
from pdgate.metaserver.store.keys import DEADLINES, EVENTS, HANDOFF, LEFT_PENDING, STATE_COUNTS, Keys, ttl_ms
from redis.commands.core import AsyncScript

__all__ = ["SCRIPTS", "config", "load_scripts", "lua_literal", "source"]

SCRIPTS = ("create", "move", "expire", "register", "heartbeat", "drain")

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}._:-% ")


def lua_literal(value: Any) -> str:
    """A Lua literal for plain data: str, bool, int, float, tuples/lists (sequences), dicts, frozensets
    (as `{MEMBER = true}`), enums (their value)."""
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if not set(value) <= _SAFE:
            raise ValueError(f"unexpected character in {value!r}")  # keys.py keeps prefixes to these
        return "'" + value + "'"
    if isinstance(value, frozenset):
        return "{" + ", ".join(f"[{lua_literal(v)}] = true" for v in sorted(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(lua_literal(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_literal(k)}] = {lua_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Lua literal for {type(value).__name__}")


def _move_row(move: ledger.Move) -> dict[str, Any]:
    return {
        "sources": move.sources,
        "to": move.to,
        "lease": move.lease,
        "field": move.field,
        "claimant": move.claimant,
        "below_max_claims": move.below_max_claims,
        "reason": move.reason,
        "reason_from": move.reason_from,
        "terminal": move.terminal,
        "lapsed_sources": move.lapsed_sources,
    }


def config(keys: Keys, policy: LedgerPolicy) -> dict[str, Any]:
    """Everything a script reads from `CFG`."""
    return {
        "deadlines_suffix": DEADLINES,
        "handoff_suffix": HANDOFF,
        "events_suffix": EVENTS,
        "state_counts_suffix": STATE_COUNTS,
        "left_pending": keys.left_pending,
        "left_pending_suffix": LEFT_PENDING,
        "buckets": len(keys.shards),
        "terminal_ttl_ms": ttl_ms(policy.terminal_ttl_s),
        "events_maxlen": policy.events_maxlen,
        "events_ttl_s": max(1, int(policy.events_ttl_s)),
        "max_claims": policy.max_claims,
        "moves": {name: _move_row(move) for name, move in ledger.MOVES.items()},
        "lapses": ledger.LAPSES,
        "kv_keys_per_ms": ledger.KV_KEYS_PER_MS,
        "claimed": ledger.CLAIMED_STATE,
        "pending": ledger.FIRST_STATE,
        "kept": registry.KEPT_ON_REREGISTER,
        "instance_prefix": keys.instance_prefix,
    }


def source(name: str, cfg: dict[str, Any]) -> str:
    """A script's full source: the CFG line, the shared library, the script."""
    lua = resources.files("pdgate.metaserver.store").joinpath("lua")
    return "\n".join(
        (
            f"local CFG = {lua_literal(cfg)}",
            lua.joinpath("_lib.lua").read_text(),
            lua.joinpath(f"{name}.lua").read_text(),
        )
    )


def load_scripts(client: aioredis.Redis, keys: Keys, policy: LedgerPolicy) -> dict[str, AsyncScript]:
    cfg = config(keys, policy)
    return {name: client.register_script(source(name, cfg)) for name in SCRIPTS}

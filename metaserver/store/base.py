"""The Store interface: the only way the metaserver reads or writes shared state.

Two backends implement it with the same semantics, checked by one contract suite (`tests/contract/`):
`memory.MemoryStore` (one process) and `redis.RedisStore` (several metaserver replicas on one Redis).
Callers pass `now` (epoch seconds) to every call that compares or sets a deadline, so the rules are the
ones of the pure cores (`ledger.MOVES`, `registry.py`) and tests may move time forward without
sleeping. Each transition is atomic (a compare-and-set): two replicas racing on one record see exactly
one winner.

Errors: `errors.HandoffNotFound`, `errors.HandoffExists`, `ledger.IllegalTransition` (carrying the state
found; `ledger.refused` builds it for both stores) and `errors.StoreUnavailable` when the backend cannot
be reached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdgate.models import (
    TERMINAL_STATES,
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HandoffState,
    Instance,
    InstanceLoad,
    InstanceState,
    KVLocation,
)

__all__ = ["LIVE_STATES", "LedgerPolicy", "Moved", "Store"]

# The states a record can still leave (the keys of `Store.count_handoffs_by_state`), in the enum's order.
LIVE_STATES: tuple[HandoffState, ...] = tuple(s for s in HandoffState if s not in TERMINAL_STATES)


@dataclass(frozen=True)
class LedgerPolicy:
    """Retention knobs a store applies by itself (from MetaSettings)."""

    terminal_ttl_s: float = 600.0
    events_maxlen: int = 10000
    events_ttl_s: float = 3600.0
    max_claims: int = 3


@dataclass(frozen=True)
class Moved:
    """A transition that happened: the state it left and the record as it is now."""

    before: HandoffState
    handoff: Handoff


class Store(ABC):
    """Abstract store. `url` names it; `policy` holds retention settings."""

    url: str
    policy: LedgerPolicy

    # -- lifecycle ---------------------------------------------------------------------------
    @abstractmethod
    async def ping(self) -> None:
        """Raise StoreUnavailable when the backend cannot serve."""

    @abstractmethod
    async def close(self) -> None: ...

    # -- registry ----------------------------------------------------------------------------
    @abstractmethod
    async def register(self, inst: Instance, *, now: float) -> Instance:
        """Upsert; a live previous record keeps its `registered_at` and `state` (see registry.new_instance)."""

    @abstractmethod
    async def heartbeat(self, instance_id: str, load: InstanceLoad | None, *, now: float) -> Instance | None:
        """Renew the lease; None when the instance is unknown or its lease already lapsed."""

    @abstractmethod
    async def drain(
        self, instance_id: str, *, now: float, state: InstanceState = InstanceState.DRAINING
    ) -> Instance | None:
        """Set a live instance's state (DRAINING; READY undoes an operator's drain); None when unknown."""

    @abstractmethod
    async def list_live_handoffs(self, *, state: HandoffState | None, limit: int) -> list[Handoff]:
        """Up to `limit` live handoffs (in `state`, or any live one), the nearest lease end first: what an
        operator looks at (`pdgate handoffs --state READY`), never a hot path."""

    @abstractmethod
    async def deregister(self, instance_id: str) -> bool:
        """True when a record was removed."""

    @abstractmethod
    async def get_instance(self, instance_id: str, *, now: float) -> Instance | None: ...

    @abstractmethod
    async def list_instances(self, *, now: float) -> list[Instance]:
        """Live instances only; lapsed ones vanish here without anyone deleting them."""

    @abstractmethod
    async def count_instances(self, *, now: float) -> int: ...

    # -- ledger ------------------------------------------------------------------------------
    @abstractmethod
    async def create_handoff(
        self, body: HandoffCreate, *, transfer_id: str, now: float, pending_lease_s: float, ready_lease_s: float
    ) -> Handoff:
        """New PENDING record with a fresh `kv_key`; HandoffExists when the id is taken."""

    @abstractmethod
    async def get_handoff(self, transfer_id: str) -> Handoff | None: ...

    @abstractmethod
    async def mark_ready(
        self, transfer_id: str, location: KVLocation, *, now: float, engine: str | None = None
    ) -> Moved:
        """PENDING -> READY, held to `ledger.check_ready` in the same atomic step (`engine`: the caller's
        engine token's instance, None for full access; the location's `engine_id` against the live
        prefill's): NotItsPrefill when refused, checked after HandoffNotFound and before the state."""

    @abstractmethod
    async def claim(self, transfer_id: str, decode_instance_id: str, *, now: float, lease_s: float) -> Moved: ...

    @abstractmethod
    async def done(self, transfer_id: str, decode_instance_id: str | None, *, now: float) -> Moved: ...

    @abstractmethod
    async def abort(self, transfer_id: str, reason: str, *, now: float) -> Moved: ...

    @abstractmethod
    async def expire_due(self, *, now: float, limit: int = 1000) -> list[Moved]:
        """Apply `ledger.lapse` to every record whose lease is due (at most `limit`); also drops retained
        terminal records and idle event feeds past their TTL. Safe to run from several replicas at once."""

    @abstractmethod
    async def count_handoffs_by_state(self) -> dict[HandoffState, int]:
        """Live (non-terminal) records per state, every live state present (0 when none).

        Why in the store: several replicas on one Redis must report the same numbers, so they come from
        the shared data (Redis keeps counters moved by the transition scripts), not from one process."""

    @abstractmethod
    async def wait_handoff(self, transfer_id: str, *, timeout: float) -> Handoff | None:
        """The record once it is no longer PENDING, or as it is when `timeout` ends; None if unknown."""

    @abstractmethod
    async def read_events(
        self, instance_id: str, cursor: str | None, *, wait: float, limit: int = 1000
    ) -> HandoffEvents:
        """Terminal events of the handoffs whose prefill is `instance_id`, after `cursor` (None: from the
        oldest kept), in order; waits up to `wait` seconds for the first one. The answer's cursor resumes
        after the last event returned. InvalidInput when the cursor is not one this store issued."""

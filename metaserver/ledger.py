"""The handoff state machine: one declarative table of moves (`MOVES`) and its Python interpreter.

    PENDING --ready--> READY --claim--> CLAIMED --done--> DONE
       |                 |  ^              |  (claim lease lapses -> READY, another decode may claim)
       |                 |  +--------------+
       |                 +--done, by the decode whose claim lapsed--> DONE
       +--- abort / lease lapse -----------+--> ABORTED | EXPIRED

Why a table, interpreted twice, and not Lua that only compares-and-sets what Python decided: a decision
in Python needs the record first, so every transition on Redis would cost a read and then a
compare-and-set, two round trips where one script call does it now (the ledger's four calls per
handoff are the metaserver's hot path). So each rule is written once, as data: `MOVES` says, for each
move, the states it may leave, the state it enters, which lease starts, which field the caller's value
fills, and what the claimant rule is. `apply` below interprets a row for the memory store; the Redis
store hands the same rows to `store/lua/_lib.lua` (as a Lua table, when its scripts are registered),
whose `apply_move` interprets them inside one atomic script call. Neither interpreter names a state or a
field of its own; the contract suite (`tests/contract/`) runs every rule against both stores.

The rules held by the table: the claimant renewal and the claimant check (`Claimant`), the lapse rule
(`LAPSES`: a lapsed claim returns to READY while fewer than `max_claims` claims have lapsed, else the
record expires), the late DONE (`Move.lapsed_sources`) and the terminal bookkeeping (entering a terminal
state ends the lease).

The late DONE: a lapsed claim returns the record to READY and keeps its claimant in `decode_instance_id`
(the last claimant; a new claim overwrites it). That decode's DONE on the READY record still succeeds:
its pull was verified while the prefill held the blocks (the record was never terminal), so DONE lets
the prefill free them at once instead of holding them for the rest of the READY lease. A DONE from
anyone else, or anonymous, on a READY record is refused as before; once another decode claimed, the
record is CLAIMED by it and the claimant check refuses the late one. Nothing here
reads a clock or touches a socket; `now` and every lease are arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import cast

from pdgate.errors import Code, PDGateError
from pdgate.models import TERMINAL_STATES, Handoff, HandoffCreate, HandoffEvent, HandoffState, KVLocation

__all__ = [
    "ALLOWED",
    "CLAIMED_STATE",
    "FIRST_STATE",
    "KV_KEYS_PER_MS",
    "LAPSES",
    "MOVES",
    "Claimant",
    "IllegalTransition",
    "Lease",
    "Move",
    "NotItsPrefill",
    "abort",
    "apply",
    "check_ready",
    "claim",
    "create",
    "done",
    "event_for",
    "kv_key_floor",
    "lapse",
    "mark_ready",
    "refused",
]

S = HandoffState

# The state of a new record (`create`); leaving it wakes the long-polls waiting for the KV location.
FIRST_STATE = S.PENDING
# The state in which a record has a claimant (`decode_instance_id`); the claimant rules apply in it.
CLAIMED_STATE = S.CLAIMED


# The kv_key clock floor, one formula for both stores (the memory store calls `kv_key_floor`; the Redis
# store's create.lua gets `KV_KEYS_PER_MS` as CFG.kv_keys_per_ms and computes the same from Redis TIME).
# A counter that lost its last writes (a restart of the memory store, a replica promoted before it caught
# up, an AOF that lost its last second, a flushed key) jumps past every key its predecessor issued,
# unless that one issued over KV_KEYS_PER_MS keys per millisecond or the clocks disagree by more than
# the restart took. With a shard's counter (kv_key = counter * buckets + bucket), the counter's floor is
# `kv_key_floor(now) // buckets`. Every value stays below 2**53 (exact in a double, so in Lua) until 2248.
KV_KEYS_PER_MS = 1024


def kv_key_floor(now: float) -> int:
    """The least kv_key a store issues at epoch time `now` (whole milliseconds * `KV_KEYS_PER_MS`)."""
    return int(now * 1000) * KV_KEYS_PER_MS


class Lease(str, Enum):
    """Which lease starts when a move enters a live state (a terminal state has none)."""

    NONE = "none"
    RECORD = "record"  # the record's own READY lease (`lease_s`, fixed at create)
    CALLER = "caller"  # the lease the caller asks for (a claim)


class Claimant(str, Enum):
    """How a move treats the decode that holds a CLAIMED record."""

    NONE = "none"
    # The caller becomes the claimant (claims += 1). The claimant asking again renews its lease and
    # moves nothing (a retried request); anyone else is refused with the claimant named.
    TAKE = "take"
    # A caller that names itself must be the claimant; an anonymous caller is not checked.
    CHECK = "check"


@dataclass(frozen=True)
class Move:
    """One row of the transition table. Both interpreters read only these fields."""

    name: str
    sources: frozenset[HandoffState]
    to: HandoffState
    lease: Lease = Lease.NONE
    field: str | None = None  # the record field that takes the caller's value ("location", "reason")
    claimant: Claimant = Claimant.NONE
    below_max_claims: bool = False  # applies only while `claims < max_claims`
    reason: str | None = None  # a fixed reason; "%s" is replaced by the state the record leaves
    # States the move may also leave, but only for a caller that names itself and is the record's last
    # claimant (`decode_instance_id`, kept when a claim lapses): the late DONE (module docstring).
    lapsed_sources: frozenset[HandoffState] = frozenset()

    @property
    def terminal(self) -> bool:
        return self.to in TERMINAL_STATES

    @property
    def reason_from(self) -> str | None:
        """Where the record's `reason` comes from on this move: "value" (the caller's), "fixed" (`reason`,
        with the state left), or None (untouched). The one precedence rule for both interpreters, which
        read this instead of deciding it: the caller's value wins over a fixed reason (an operator's
        words say more than the table's default)."""
        if self.field == "reason":
            return "value"
        return "fixed" if self.reason is not None else None


_LIVE = frozenset(s for s in S if s not in TERMINAL_STATES)

MOVES: Mapping[str, Move] = {
    m.name: m
    for m in (
        Move("ready", frozenset({S.PENDING}), S.READY, Lease.RECORD, field="location"),
        Move("claim", frozenset({S.READY}), S.CLAIMED, Lease.CALLER, claimant=Claimant.TAKE),
        Move("done", frozenset({S.CLAIMED}), S.DONE, claimant=Claimant.CHECK, lapsed_sources=frozenset({S.READY})),
        Move("abort", _LIVE, S.ABORTED, field="reason"),
        # The sweeper's moves, tried in `LAPSES` order on a record whose lease is due. A requeued record
        # keeps its last claimant (the late DONE); the next claim replaces it.
        Move("requeue", frozenset({S.CLAIMED}), S.READY, Lease.RECORD, below_max_claims=True),
        Move("expire", _LIVE, S.EXPIRED, reason="%s lease lapsed"),
    )
}
LAPSES: tuple[str, ...] = ("requeue", "expire")

# Every legal (from -> to), derived from `MOVES` for readers and tests; nothing decides with it.
ALLOWED: Mapping[HandoffState, frozenset[HandoffState]] = {
    state: frozenset(m.to for m in MOVES.values() if state in m.sources | m.lapsed_sources) for state in S
}
assert all((m.lease is Lease.NONE) == m.terminal for m in MOVES.values()), "a live state needs a lease"


class IllegalTransition(PDGateError):
    """The record is not in a state from which the asked move is legal.

    Carries the state found, so the API can answer 409 (live record) or 410 (terminal record) with
    `current_state`, and a caller can tell "someone else claimed it" from "it is gone".
    """

    code = Code.ILLEGAL_TRANSITION

    def __init__(self, current: HandoffState, to: HandoffState, detail: str | None = None) -> None:
        self.current = current
        self.to = to
        super().__init__(
            detail or f"cannot move a {current.value} handoff to {to.value}",
            code=Code.HANDOFF_TERMINAL if current in TERMINAL_STATES else None,
        )

    @property
    def detail(self) -> str:
        return self.message

    @property
    def terminal(self) -> bool:
        return self.current in TERMINAL_STATES


def refused(
    move: Move, current: HandoffState, *, claimant: str | None = None, caller: str | None = None
) -> IllegalTransition:
    """The error of a refused move; `claimant` is set when the claimant rule refused it."""
    if claimant is None:
        return IllegalTransition(current, move.to)
    if move.claimant is Claimant.TAKE:
        return IllegalTransition(current, move.to, f"handoff already claimed by {claimant}")
    return IllegalTransition(current, move.to, f"handoff is claimed by {claimant}, not {caller}")


class NotItsPrefill(PDGateError):
    """A READY refused by `check_ready`. `rule` says which: "engine" (the caller's engine token names
    another instance; 403) or "engine_id" (the location names another engine than `registered`, the
    one the prefill registered with; 422). The service words both (service.py), as one error per rule."""

    def __init__(self, rule: str, prefill_instance_id: str, registered: str | None = None) -> None:
        self.rule = rule
        self.prefill_instance_id = prefill_instance_id
        self.registered = registered
        code = Code.FORBIDDEN if rule == "engine" else Code.VALIDATION_ERROR
        super().__init__(f"READY refused by the {rule} rule (prefill {prefill_instance_id})", code=code)


def check_ready(prefill_instance_id: str, *, engine: str | None, engine_id: str | None, registered: str | None) -> None:
    """READY only by the handoff's own prefill, or NotItsPrefill: an engine token (`engine`, the instance
    it names; None for full access) must be that prefill's, and a location's `engine_id` (None: not
    stated) must be the one the prefill registered (`registered`: None when the prefill is not a live
    registered instance or stated no engine_id, and then any engine_id passes). The engine rule first.

    Why in the stores, in the move's atomic step: checked before the move, it cost two reads (record,
    then instance) per READY on Redis. The memory store calls this under its lock; on one Redis its twin
    is `check_ready` in store/lua/_lib.lua (same order, same outcomes); on a Cluster store/redis.py reads
    and calls this."""
    if engine is not None and engine != prefill_instance_id:
        raise NotItsPrefill("engine", prefill_instance_id)
    if engine_id is not None and registered is not None and engine_id != registered:
        raise NotItsPrefill("engine_id", prefill_instance_id, registered)


def apply(
    move: Move,
    rec: Handoff,
    *,
    now: float,
    caller: str | None = None,
    value: object = None,
    lease_s: float | None = None,
    max_claims: int = 0,
) -> Handoff:
    """`rec` after `move` (a new record; the input is untouched), or IllegalTransition.

    `caller` is the decode instance asking (claim, done), `value` fills `move.field`, `lease_s` is the
    caller's lease (`Lease.CALLER`), `max_claims` bounds `below_max_claims`.
    """
    if rec.state is CLAIMED_STATE:
        holder = rec.decode_instance_id
        if move.claimant is Claimant.TAKE:
            if holder == caller:
                return rec.model_copy(update={"updated_at": now, "deadline": now + _lease(move, rec, lease_s)})
            raise refused(move, rec.state, claimant=holder or "", caller=caller)
        if move.claimant is Claimant.CHECK and caller is not None and caller != holder:
            raise refused(move, rec.state, claimant=holder or "", caller=caller)
    if rec.state in move.lapsed_sources:  # the late DONE: only the last claimant, naming itself
        if caller is None or caller != rec.decode_instance_id:
            raise refused(move, rec.state)
    elif not _applies(move, rec, max_claims):
        raise refused(move, rec.state)
    update: dict[str, object] = {
        "state": move.to,
        "updated_at": now,
        "deadline": None if move.terminal else now + _lease(move, rec, lease_s),
    }
    if move.field is not None:
        update[move.field] = value
    if move.reason_from == "fixed":
        update["reason"] = cast(str, move.reason) % rec.state.value
    if move.claimant is Claimant.TAKE:
        update.update(decode_instance_id=caller, claims=rec.claims + 1)
    return rec.model_copy(update=update)


def _applies(move: Move, rec: Handoff, max_claims: int) -> bool:
    return rec.state in move.sources and not (move.below_max_claims and rec.claims >= max_claims)


def _lease(move: Move, rec: Handoff, lease_s: float | None) -> float:
    if move.lease is Lease.RECORD:
        return rec.lease_s
    if lease_s is None:
        raise ValueError(f"move {move.name} needs the caller's lease")
    return lease_s


def create(
    body: HandoffCreate, *, transfer_id: str, kv_key: int, now: float, pending_lease_s: float, ready_lease_s: float
) -> Handoff:
    """A new PENDING record. `lease_s` on the record is its READY lease (the body's, else the default)."""
    return Handoff(
        transfer_id=transfer_id,
        kv_key=kv_key,
        state=FIRST_STATE,
        prefill_instance_id=body.prefill_instance_id,
        request_id=body.request_id,
        created_at=now,
        updated_at=now,
        deadline=now + pending_lease_s,
        lease_s=body.lease_s if body.lease_s is not None else ready_lease_s,
    )


def mark_ready(rec: Handoff, location: KVLocation, *, now: float) -> Handoff:
    """PENDING -> READY: the prefill recorded where its KV lives; the READY lease starts now."""
    return apply(MOVES["ready"], rec, now=now, value=location)


def claim(rec: Handoff, decode_instance_id: str, *, now: float, lease_s: float) -> Handoff:
    """READY -> CLAIMED for one decode (see `Claimant.TAKE`)."""
    return apply(MOVES["claim"], rec, now=now, caller=decode_instance_id, lease_s=lease_s)


def done(rec: Handoff, decode_instance_id: str | None, *, now: float) -> Handoff:
    """CLAIMED -> DONE (see `Claimant.CHECK`), or READY -> DONE by the decode whose claim lapsed."""
    return apply(MOVES["done"], rec, now=now, caller=decode_instance_id)


def abort(rec: Handoff, reason: str, *, now: float) -> Handoff:
    """Any live state -> ABORTED; the prefill frees its blocks when the event reaches it."""
    return apply(MOVES["abort"], rec, now=now, value=reason)


def lapse(rec: Handoff, *, now: float, max_claims: int) -> Handoff | None:
    """What the sweeper does to a record whose lease is due (the first of `LAPSES` that applies); None
    when nothing is due. `max_claims` bounds how often a lapsed claim returns to READY, so a record
    cannot pin a prefill's blocks forever."""
    if rec.state in TERMINAL_STATES or rec.deadline is None or rec.deadline > now:
        return None
    for name in LAPSES:
        if _applies(MOVES[name], rec, max_claims):
            return apply(MOVES[name], rec, now=now, max_claims=max_claims)
    return None


def event_for(rec: Handoff) -> HandoffEvent:
    """The feed entry of a terminal record."""
    return HandoffEvent(
        transfer_id=rec.transfer_id, kv_key=rec.kv_key, state=rec.state, reason=rec.reason, at=rec.updated_at
    )

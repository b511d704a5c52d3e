"""The handoff state machine, as pure functions over `Handoff` records.

Why a pure core: the memory store applies these functions under its lock, the Redis store applies the
same rules inside Lua scripts, and the contract suite checks that both agree. Nothing here reads a clock
or touches a socket; `now` and every lease are arguments, so each rule is testable in microseconds.

    PENDING --ready--> READY --claim--> CLAIMED --done--> DONE
       |                 |                 |  (claim lease lapses -> READY, another decode may claim)
       +--- abort / lease lapse -----------+--> ABORTED | EXPIRED

`ALLOWED` is the only table of legal moves. The Redis scripts receive the source states of their move
from `sources()`, so the table is not written a second time in Lua.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdgate.metaserver.models import TERMINAL_STATES, Handoff, HandoffCreate, HandoffEvent, HandoffState, KVLocation

__all__ = [
    "ALLOWED",
    "OPERATIONS",
    "IllegalTransition",
    "abort",
    "claim",
    "create",
    "done",
    "event_for",
    "lapse",
    "mark_ready",
    "sources",
    "transition",
]

S = HandoffState

ALLOWED: Mapping[HandoffState, frozenset[HandoffState]] = {
    S.PENDING: frozenset({S.READY, S.ABORTED, S.EXPIRED}),
    S.READY: frozenset({S.CLAIMED, S.ABORTED, S.EXPIRED}),
    # CLAIMED -> READY is the claim lease lapsing; CLAIMED -> EXPIRED is the last allowed claim lapsing.
    S.CLAIMED: frozenset({S.DONE, S.ABORTED, S.READY, S.EXPIRED}),
    S.DONE: frozenset(),
    S.ABORTED: frozenset(),
    S.EXPIRED: frozenset(),
}


def sources(to: HandoffState) -> frozenset[HandoffState]:
    """The states from which `to` may be entered by some move."""
    return frozenset(src for src, targets in ALLOWED.items() if to in targets)


# What each caller-driven operation must find (its compare-and-set). Narrower than `sources()` where two
# moves share a target: READY is entered by `ready` from PENDING only; CLAIMED -> READY is the sweeper's.
OPERATIONS: Mapping[str, frozenset[HandoffState]] = {
    "ready": frozenset({S.PENDING}),
    "claim": frozenset({S.READY}),
    "done": frozenset({S.CLAIMED}),
    "abort": sources(S.ABORTED),
    "expire": sources(S.EXPIRED),
}
_TARGETS = {"ready": S.READY, "claim": S.CLAIMED, "done": S.DONE, "abort": S.ABORTED, "expire": S.EXPIRED}
assert all(OPERATIONS[op] <= sources(to) for op, to in _TARGETS.items()), "OPERATIONS must follow ALLOWED"


def _require(op: str, rec: Handoff) -> None:
    if rec.state not in OPERATIONS[op]:
        raise IllegalTransition(rec.state, _TARGETS[op])


class IllegalTransition(Exception):
    """The record is not in a state from which the asked move is legal.

    Carries the state found, so the API can answer 409 (live record) or 410 (terminal record) with
    `current_state`, and a caller can tell "someone else claimed it" from "it is gone".
    """

    def __init__(self, current: HandoffState, to: HandoffState, detail: str | None = None) -> None:
        self.current = current
        self.to = to
        self.detail = detail or f"cannot move a {current.value} handoff to {to.value}"
        super().__init__(self.detail)

    @property
    def terminal(self) -> bool:
        return self.current in TERMINAL_STATES


def transition(
    rec: Handoff, to: HandoffState, *, now: float, lease_s: float | None = None, **changes: object
) -> Handoff:
    """Move `rec` to `to` if `ALLOWED` permits it; non-terminal targets need the lease of the new state."""
    if to not in ALLOWED[rec.state]:
        raise IllegalTransition(rec.state, to)
    if to in TERMINAL_STATES:
        deadline = None
    else:
        if lease_s is None:
            raise ValueError(f"entering {to.value} needs a lease")
        deadline = now + lease_s
    update: dict[str, object] = {"state": to, "updated_at": now, "deadline": deadline}
    update.update(changes)
    return rec.model_copy(update=update)


def create(
    body: HandoffCreate, *, transfer_id: str, kv_key: int, now: float, pending_lease_s: float, ready_lease_s: float
) -> Handoff:
    """A new PENDING record. `lease_s` on the record is its READY lease (the body's, else the default)."""
    return Handoff(
        transfer_id=transfer_id,
        kv_key=kv_key,
        state=S.PENDING,
        prefill_instance_id=body.prefill_instance_id,
        request_id=body.request_id,
        created_at=now,
        updated_at=now,
        deadline=now + pending_lease_s,
        lease_s=body.lease_s if body.lease_s is not None else ready_lease_s,
    )


def mark_ready(rec: Handoff, location: KVLocation, *, now: float) -> Handoff:
    """PENDING -> READY: the prefill recorded where its KV lives; the READY lease starts now."""
    _require("ready", rec)
    return transition(rec, S.READY, now=now, lease_s=rec.lease_s, location=location)


def claim(rec: Handoff, decode_instance_id: str, *, now: float, lease_s: float) -> Handoff:
    """READY -> CLAIMED for one decode. The claimant may claim again (a retried request) and renews its lease."""
    if rec.state is S.CLAIMED:
        if rec.decode_instance_id == decode_instance_id:
            return rec.model_copy(update={"updated_at": now, "deadline": now + lease_s})
        raise IllegalTransition(rec.state, S.CLAIMED, f"handoff already claimed by {rec.decode_instance_id}")
    _require("claim", rec)
    return transition(
        rec, S.CLAIMED, now=now, lease_s=lease_s, decode_instance_id=decode_instance_id, claims=rec.claims + 1
    )


def done(rec: Handoff, decode_instance_id: str | None, *, now: float) -> Handoff:
    """CLAIMED -> DONE. When the caller names itself, only the claimant may finish."""
    if rec.state is S.CLAIMED and decode_instance_id is not None and decode_instance_id != rec.decode_instance_id:
        raise IllegalTransition(
            rec.state, S.DONE, f"handoff is claimed by {rec.decode_instance_id}, not {decode_instance_id}"
        )
    _require("done", rec)
    return transition(rec, S.DONE, now=now)


def abort(rec: Handoff, reason: str, *, now: float) -> Handoff:
    """Any live state -> ABORTED; the prefill frees its blocks when the event reaches it."""
    _require("abort", rec)
    return transition(rec, S.ABORTED, now=now, reason=reason)


def lapse(rec: Handoff, *, now: float, max_claims: int) -> Handoff | None:
    """What the sweeper does to a record whose lease is due; None when nothing is due.

    A lapsed claim returns the record to READY (with a fresh READY lease) so another decode can pull
    without a new prefill, until `max_claims` claims have lapsed: then the KV is given up (EXPIRED),
    so a record cannot pin a prefill's blocks forever.
    """
    if rec.state in TERMINAL_STATES or rec.deadline is None or rec.deadline > now:
        return None
    if rec.state is S.CLAIMED and rec.claims < max_claims:
        return transition(rec, S.READY, now=now, lease_s=rec.lease_s, decode_instance_id=None)
    return transition(rec, S.EXPIRED, now=now, reason=f"{rec.state.value} lease lapsed")


def event_for(rec: Handoff) -> HandoffEvent:
    """The feed entry of a terminal record."""
    return HandoffEvent(
        transfer_id=rec.transfer_id, kv_key=rec.kv_key, state=rec.state, reason=rec.reason, at=rec.updated_at
    )

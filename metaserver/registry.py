"""Registry rules, as pure functions over `Instance` records.

Why pure: the lease arithmetic is where "an instance that stopped heartbeating disappears by itself" is
decided; it is tested here with an explicit `now`, no sleeping. Both stores decide with these functions
(the memory store calls them; the Redis store parses what it read and calls `is_live`). The Redis
scripts that must decide atomically read the same declarations: `KEPT_ON_REREGISTER` reaches
`register.lua` as data, and `is_live` has one Lua twin, `instance_live` in `store/lua/_lib.lua`, which
the contract suite holds to it at the lease's last instant.
"""

from __future__ import annotations

from pdgate.errors import Code, PDGateError
from pdgate.models import Instance, InstanceLoad, InstanceRegistration, InstanceState, Role

__all__ = [
    "KEPT_ON_REREGISTER",
    "RegistrationInvalid",
    "end_drain",
    "is_live",
    "matches",
    "new_instance",
    "renew",
    "reregister",
    "start_drain",
    "validate",
]

# What a live record keeps when its instance registers again (an operator's drain survives a
# connector's periodic re-registration).
KEPT_ON_REREGISTER: tuple[str, ...] = ("registered_at", "state")


class RegistrationInvalid(PDGateError):
    """A registration that the model accepts field by field but that makes no sense as a whole."""

    code = Code.VALIDATION_ERROR

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        super().__init__(f"{field}: {detail}")


def validate(reg: InstanceRegistration) -> None:
    """Cross-field checks the pydantic model cannot express alone; raises RegistrationInvalid."""
    seen: set[int] = set()
    for i, addr in enumerate(reg.transport_addresses):
        if addr.tp_rank in seen:
            raise RegistrationInvalid(
                f"transport_addresses[{i}].tp_rank", f"tp_rank {addr.tp_rank} appears twice; one address per TP rank"
            )
        seen.add(addr.tp_rank)


def is_live(inst: Instance, now: float) -> bool:
    """An instance counts until its heartbeat lease lapses; after that it is unknown (404, not listed)."""
    return now <= inst.last_heartbeat + inst.lease_s


def new_instance(
    reg: InstanceRegistration, *, now: float, default_lease_s: float, existing: Instance | None = None
) -> Instance:
    """The record stored for a registration; registering again is an update (see `reregister`)."""
    data = reg.model_dump()
    data.update(
        lease_s=reg.lease_s if reg.lease_s is not None else default_lease_s,
        registered_at=now,
        last_heartbeat=now,
        state=InstanceState.READY,
    )
    return reregister(Instance.model_validate(data), existing, now=now)


def reregister(inst: Instance, previous: Instance | None, *, now: float) -> Instance:
    """`inst` with the `KEPT_ON_REREGISTER` fields of `previous` while that is live; a lapsed record
    counts as absent."""
    if previous is None or not is_live(previous, now):
        return inst
    return inst.model_copy(update={name: getattr(previous, name) for name in KEPT_ON_REREGISTER})


def renew(inst: Instance, *, now: float, load: InstanceLoad | None) -> Instance:
    """A heartbeat: the lease restarts at `now`; load is replaced when the body carries one."""
    update: dict[str, object] = {"last_heartbeat": now}
    if load is not None:
        update["load"] = load
    return inst.model_copy(update=update)


def start_drain(inst: Instance) -> Instance:
    """DRAINING instances stay listed (their work finishes) but the router gives them nothing new."""
    return inst.model_copy(update={"state": InstanceState.DRAINING})


def end_drain(inst: Instance) -> Instance:
    """An operator's undrain (`pdgate undrain`): the instance takes new work again."""
    return inst.model_copy(update={"state": InstanceState.READY})


def matches(inst: Instance, *, role: Role | None, model: str | None, state: InstanceState | None) -> bool:
    """Listing filters. `role=prefill` (or decode) also returns `both` instances: they can serve it."""
    if role is Role.PREFILL and not inst.role.can_prefill():
        return False
    if role is Role.DECODE and not inst.role.can_decode():
        return False
    if role is Role.BOTH and inst.role is not Role.BOTH:
        return False
    if model is not None and inst.model != model:
        return False
    return state is None or inst.state is state

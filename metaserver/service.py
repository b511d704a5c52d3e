"""MetaService: the metaserver's operations on top of a store, shared by the HTTP routes and in-process use.

Why a layer between routes and store: the same operations serve `api.py` (over HTTP) and
`local.LocalMetaClient` (the router's embedded mode, no HTTP hop), with the same validation, the same
errors and the same metrics. This is where the pure cores' refusals become the service's errors
(`errors.core_errors`). The clock and the id factory are injected so tests can drive them.

`engine`: the instance id of the caller's engine token (`guards.check_engine`), None for full access
(the admin token, in-process callers). Each move checks it here, so a single route and a batch item
are held to the same rule; READY hands it to the store, which checks `ledger.check_ready` in the move's
own atomic step (on one Redis, inside the move script: no read before the move).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from pdgate.metaserver import ledger, registry
from pdgate.metaserver.errors import HandoffNotFound, InstanceNotFound, InvalidInput, core_errors
from pdgate.metaserver.guards import check_cursor, check_engine
from pdgate.metaserver.metrics import MetaMetrics
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store.base import Moved, Store
from prometheus_client import Counter

from pdgate import logs
from pdgate.models import (
    Handoff,
    HandoffCreate,
    HandoffEvents,
    HandoffState,
    HeartbeatResponse,
    Instance,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    RegisterResponse,
    Role,
    is_valid_id,
)

__all__ = ["MetaService", "check_id"]

log = logging.getLogger(__name__)


def check_id(value: str, what: str) -> str:
    """Ids arrive in URL paths too; refuse what could not have been registered (and could forge keys)."""
    if not is_valid_id(value):
        raise InvalidInput(
            f"path.{what}: {value!r} is not a valid id (1-128 of A-Z a-z 0-9 . _ : -, starting alphanumeric)"
        )
    return value


def _not_its_prefill(exc: ledger.NotItsPrefill, location: KVLocation, engine: str | None) -> InvalidInput:
    """A READY refused by `ledger.check_ready` (in the store's move step), as the caller sees it: the
    engine rule is `check_engine`'s 403, the engine_id rule a 422 naming the field."""
    prefill = exc.prefill_instance_id
    if exc.rule == "engine":
        check_engine(engine, (prefill,), f"mark READY a handoff of prefill {prefill}")  # raises Forbidden
    return InvalidInput(
        f"body.engine_id: {location.engine_id!r} is not the engine of this handoff's prefill {prefill} "
        f"({exc.registered!r})"
    )


class MetaService:
    def __init__(
        self,
        store: Store,
        settings: MetaSettings,
        metrics: MetaMetrics | None = None,
        *,
        clock: Callable[[], float] = time.time,
        new_transfer_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics or MetaMetrics()
        self.clock = clock
        self._new_transfer_id = new_transfer_id
        self._transitions: dict[tuple[HandoffState, HandoffState], Counter] = {}  # see `_moved`

    # -- registry ----------------------------------------------------------------------------
    async def register(self, reg: InstanceRegistration, *, engine: str | None = None) -> RegisterResponse:
        check_engine(engine, (reg.id,), f"register instance {reg.id}")
        with core_errors("body"):
            registry.validate(reg)
        now = self.clock()
        inst = registry.new_instance(reg, now=now, default_lease_s=self.settings.instance_lease_s)
        inst = await self.store.register(inst, now=now)
        log.info("instance %s registered (%s, %s, %s)", inst.id, inst.role.value, inst.model, inst.url)
        return RegisterResponse(lease_s=inst.lease_s, instance=inst)

    async def heartbeat(
        self, instance_id: str, load: InstanceLoad | None = None, *, engine: str | None = None
    ) -> HeartbeatResponse:
        check_id(instance_id, "instance_id")
        check_engine(engine, (instance_id,), f"renew the lease of {instance_id}")
        inst = await self.store.heartbeat(instance_id, load, now=self.clock())
        if inst is None:
            raise InstanceNotFound(f"instance {instance_id} is not registered (or its lease lapsed): register again")
        return HeartbeatResponse(lease_s=inst.lease_s, state=inst.state)

    async def drain(self, instance_id: str, *, engine: str | None = None) -> Instance:
        check_id(instance_id, "instance_id")
        check_engine(engine, (instance_id,), f"drain {instance_id}")
        inst = await self.store.drain(instance_id, now=self.clock())
        if inst is None:
            raise InstanceNotFound(f"instance {instance_id} is not registered")
        log.info("instance %s draining", instance_id)
        return inst

    async def undrain(self, instance_id: str, *, engine: str | None = None) -> Instance:
        """Undo a drain (`pdgate undrain`): the instance takes new work again."""
        check_id(instance_id, "instance_id")
        check_engine(engine, (instance_id,), f"undrain {instance_id}")
        inst = await self.store.drain(instance_id, now=self.clock(), state=InstanceState.READY)
        if inst is None:
            raise InstanceNotFound(f"instance {instance_id} is not registered")
        log.info("instance %s takes work again (undrained)", instance_id)
        return inst

    async def deregister(self, instance_id: str, *, engine: str | None = None) -> None:
        check_id(instance_id, "instance_id")
        check_engine(engine, (instance_id,), f"remove {instance_id}")
        if not await self.store.deregister(instance_id):
            raise InstanceNotFound(f"instance {instance_id} is not registered")
        log.info("instance %s deregistered", instance_id)

    async def list_handoffs(self, *, state: HandoffState | None = None, limit: int = 100) -> list[Handoff]:
        """Live handoffs for an operator (`pdgate handoffs`); a finished one is read by its id."""
        if state is not None and state.terminal:
            raise InvalidInput(f"state={state.value}: only live handoffs (PENDING, READY, CLAIMED) are listed")
        return await self.store.list_live_handoffs(state=state, limit=limit)

    async def list_instances(
        self, *, role: Role | None = None, model: str | None = None, state: InstanceState | None = None
    ) -> list[Instance]:
        found = await self.store.list_instances(now=self.clock())
        return [i for i in found if registry.matches(i, role=role, model=model, state=state)]

    async def get_instance(self, instance_id: str) -> Instance:
        check_id(instance_id, "instance_id")
        inst = await self.store.get_instance(instance_id, now=self.clock())
        if inst is None:
            raise InstanceNotFound(f"instance {instance_id} is not registered")
        return inst

    # -- handoff ledger ----------------------------------------------------------------------
    async def create_handoff(self, body: HandoffCreate, *, engine: str | None = None) -> Handoff:
        check_engine(engine, (body.prefill_instance_id,), f"create a handoff for prefill {body.prefill_instance_id}")
        tid = body.transfer_id or self._new_transfer_id()
        logs.transfer_id.set(tid)
        s = self.settings
        rec = await self.store.create_handoff(
            body, transfer_id=tid, now=self.clock(), pending_lease_s=s.pending_lease_s, ready_lease_s=s.ready_lease_s
        )
        self.metrics.handoffs_created.inc()
        log.debug("handoff created for prefill %s, kv_key %d", rec.prefill_instance_id, rec.kv_key)
        return rec

    def _moved(self, moved: Moved) -> Handoff:
        """Count and log one ledger move. Runs 3 times per request, so the per-pair counter child is kept
        (prometheus' `labels()` costs ~3 us a call) and the debug line's arguments are built only when
        that level is on."""
        rec = moved.handoff
        before, after = moved.before, rec.state
        if before is not after:
            child = self._transitions.get((before, after))
            if child is None:
                child = self._transitions[(before, after)] = self.metrics.transitions.labels(before.value, after.value)
            child.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("handoff %s -> %s", before.value, after.value)
        return rec

    async def mark_ready(self, transfer_id: str, location: KVLocation, *, engine: str | None = None) -> Handoff:
        logs.transfer_id.set(check_id(transfer_id, "transfer_id"))
        try:
            with core_errors(transfer_id):
                moved = await self.store.mark_ready(transfer_id, location, now=self.clock(), engine=engine)
        except ledger.NotItsPrefill as exc:
            raise _not_its_prefill(exc, location, engine) from None
        return self._moved(moved)

    async def claim(
        self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None, *, engine: str | None = None
    ) -> Handoff:
        logs.transfer_id.set(check_id(transfer_id, "transfer_id"))
        check_id(decode_instance_id, "decode_instance_id")
        check_engine(engine, (decode_instance_id,), f"claim for decode {decode_instance_id}")
        lease = lease_s if lease_s is not None else self.settings.claim_lease_s
        with core_errors(transfer_id):
            return self._moved(await self.store.claim(transfer_id, decode_instance_id, now=self.clock(), lease_s=lease))

    async def done(
        self, transfer_id: str, decode_instance_id: str | None = None, *, engine: str | None = None
    ) -> Handoff:
        logs.transfer_id.set(check_id(transfer_id, "transfer_id"))
        check_engine(engine, (decode_instance_id,), f"finish a handoff as decode {decode_instance_id}")
        with core_errors(transfer_id):
            return self._moved(await self.store.done(transfer_id, decode_instance_id, now=self.clock()))

    async def abort(self, transfer_id: str, reason: str, *, engine: str | None = None) -> Handoff:
        logs.transfer_id.set(check_id(transfer_id, "transfer_id"))
        if engine is not None:
            found = await self.store.get_handoff(transfer_id)
            if found is not None:
                parties = (found.prefill_instance_id, found.decode_instance_id)
                check_engine(engine, parties, "abort a handoff it is not party to")
        with core_errors(transfer_id):
            rec = self._moved(await self.store.abort(transfer_id, reason, now=self.clock()))
        log.info("handoff aborted: %s", reason)
        return rec

    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff:
        logs.transfer_id.set(check_id(transfer_id, "transfer_id"))
        timeout = min(max(wait or 0.0, 0.0), self.settings.max_wait_s)
        if timeout > 0:
            rec = await self.store.wait_handoff(transfer_id, timeout=timeout)
        else:
            rec = await self.store.get_handoff(transfer_id)
        if rec is None:
            raise HandoffNotFound(f"handoff {transfer_id} not found")
        return rec

    async def events(self, instance_id: str, cursor: str | None = None, wait: float | None = None) -> HandoffEvents:
        check_id(instance_id, "instance_id")
        check_cursor(cursor)  # one grammar for both stores, before either sees it
        timeout = min(max(wait or 0.0, 0.0), self.settings.max_wait_s)
        return await self.store.read_events(instance_id, cursor, wait=timeout)

    # -- maintenance -------------------------------------------------------------------------
    async def expire_due(self) -> list[Moved]:
        """One sweeper step (see sweeper.py): move every lapsed lease, count and log it."""
        moved = await self.store.expire_due(now=self.clock())
        for m in moved:
            rec = m.handoff
            self.metrics.lease_expiries.labels(m.before.value, rec.state.value).inc()
            self.metrics.transitions.labels(m.before.value, rec.state.value).inc()
            context = logs.transfer_id.set(rec.transfer_id)
            if rec.state is HandoffState.EXPIRED:
                log.info("handoff expired: %s (prefill %s)", rec.reason, rec.prefill_instance_id)
            else:
                log.info("claim by a decode lapsed; handoff READY again (claims so far: %d)", rec.claims)
            logs.transfer_id.reset(context)
        return moved

    async def health(self) -> dict[str, object]:
        await self.store.ping()
        return {"status": "ok", "store": self.store.url.split("://", 1)[0]}

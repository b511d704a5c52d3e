"""The router's instances: a snapshot of frozen `InstanceView`s, each wrapped in a `LiveInstance`.

Two names, two concepts: an `InstanceView` is what the registry (or a flag) says about one instance
and is replaced on every refresh; a `LiveInstance` is the router's own record of that instance and
survives refreshes: in-flight requests and tokens (the load the policies read), the circuit breaker
and the last active health check. One record per DP rank, so load and breakers are per rank. The
policies choose among `LiveInstance`s.

The snapshot is replaced as a whole by the background refresh (registry and static instances), never
rebuilt per request. Load accounting goes through `Pool.lease`, the one place where a request starts
and stops counting against an instance and where its outcome reaches the breaker.

Eligible = not draining, model known, last health check passed, breaker lets a request through, and
(for a prefill) at least one eligible decode can take its KV. Which decodes can take which prefill's KV
is computed once per change of the instances' compatibility fields, not per request, and by class, not
by pair: whether a decode can take a prefill's KV depends only on their `InstanceView.compat_key`s
(the fields `pdgate.contract.mismatch` reads), so instances are grouped by key and the rule
runs once per pair of classes. A fleet has a handful of classes, so one registration or removal costs
O(P + D) (grouping, plus one decode list per prefill class) instead of O(P x D): at 1,000 x 1,000 it
took half a second of the event loop per change (bench/pool.py measures both).

A shared outage is not an instance's failure: while the ledger (metaserver or its store) is known to be
down, every decode fails its claim and every prefill its READY, and counting that against their breakers
would open all of them, so that after the store is back the router would answer `pd_no_compatible_pair`
for `breaker_open_s`. `ledger_outage` stops the verdicts while it lasts and forgives the breakers that
opened in the moments before it was noticed; the health checks still judge each instance meanwhile.

Routing decisions at fleet size: a decision used to test every instance of the model (`unavailable`),
O(P + D) Python calls per request (bench/pool.py: ~135 us each side at 1,000 x 1,000). Most of the time
every instance is either plainly in rotation (healthy, breaker closed, not draining) or plainly out of
it (draining or unhealthy), and that only changes at a refresh, a health verdict or a breaker move. So
the candidates of a model, and the decodes of a class, are kept as lists built once per such change
(`_fast_prefills`, `_fast_decodes`, and both sides for whole requests; every such change calls
`_invalidate`). A list is kept only when it does not depend on the clock: while any instance it would
judge has a breaker that is not closed (open or half-open: whether it passes depends on `now` and on its
probe), the decision tests instance by instance as before. Same candidates, same order, either way
(tests/unit/router/test_router_pool_fast.py checks both against each other under random changes).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace as replace_view
from types import TracebackType

from pdgate.router.breaker import BreakerConfig, BreakerState, CircuitBreaker
from pdgate.router.left_out import LeftOut, left_out_said
from pdgate.router.pairing import InstanceView, explain, incompatibility
from pdgate.router.pairing import compatible as compatible_views

from pdgate.models import Role

__all__ = ["Lease", "LiveInstance", "Pool"]


class LiveInstance:
    """The router's live record of one instance (one DP rank): load, breaker, health."""

    __slots__ = (
        "breaker",
        "compat",
        "health_reason",
        "healthy",
        "id",
        "own_at_report",
        "peak",
        "public",
        "requests",
        "tokens",
        "view",
    )

    def __init__(self, view: InstanceView, breaker: CircuitBreaker, public: str = "") -> None:
        self.id = view.id
        self.public = public or view.id  # what a client may read for this instance (`Pool.public_name`)
        self.view = view
        self.requests = 0
        self.tokens = 0
        self.own_at_report = 0  # the most `requests` reached between the last two reports' arrivals
        self.peak = 0  # the most `requests` reached since the current report came in (`Pool.lease`)
        self.breaker = breaker
        self.healthy = True
        self.health_reason = ""
        self.compat = -1  # its compatibility class: a small int per distinct compat key (set by Pool._rebuild)

    @property
    def others(self) -> int:
        """The requests others (router replicas, workers, direct clients) had on the instance as of its last
        report: what it reported running and waiting, less the most this router had in flight to it while
        that report could have been taken (between the previous report's arrival and this one's). Requests
        this router sent count live, in `requests`.

        Not the report itself: after a burst, an idle engine still reports the burst until its next
        heartbeat reaches the registry and this router (a second or two), and a report taken as load kept
        steering requests away from it meanwhile. Nor the report less this router's count when it came in:
        a report taken while a conversation's turn was on the engine and read after the turn ended counted
        that turn as somebody else's until the next heartbeat, and the next turn went to the wrong engine
        (test_16 had to wait for idle reports). The most this router had in flight meanwhile is at least
        what it had when the engine took the report, so the estimate never counts this router's own
        requests; another replica's show once they exceed this router's own swing in that window."""
        others = self.view.reported - self.own_at_report
        return others if others > 0 else 0

    def where(self, side: str) -> tuple[str, str]:
        """This instance serving `side`, as a client reads it (the opaque name) and as the log and the
        admin read it (the instance id too): the `where` of `errors.Where`."""
        return f"{side} {self.public}", f"{side} {self.id} ({self.public})"

    def unavailable(self, now: float) -> str | None:
        """Why this instance takes no new work now, or None."""
        v = self.view
        if v.draining:
            return "is draining"
        if v.model is None:
            return "has not told its model yet (GET /v1/models)"
        if not self.healthy:
            return f"failed its health check ({self.health_reason})"
        if not self.breaker.can_pass(now):
            return f"has its circuit breaker {self.breaker.state(now).value}"
        return None


class Pool:
    def __init__(
        self,
        breaker: BreakerConfig | None = None,
        on_breaker: Callable[[str, BreakerState], None] | None = None,
        on_inflight: Callable[[LiveInstance], None] | None = None,
    ) -> None:
        self._breaker_cfg = breaker or BreakerConfig()
        self._on_breaker = on_breaker
        self._on_inflight = on_inflight
        self.instances: dict[str, LiveInstance] = {}
        self.prefills: dict[str, list[LiveInstance]] = {}  # model -> prefill-capable instances
        self.decodes: dict[str, list[LiveInstance]] = {}  # model -> decode-capable instances
        # prefill class -> the decodes (sorted by id) that can take its KV. Classes are ints, not the
        # key tuples: a tuple's hash is computed on every lookup, and a decision looks up every prefill.
        self._compatible: dict[int, list[LiveInstance]] = {}
        self._by_url: dict[str, list[LiveInstance]] = {}
        self._fingerprint: tuple[object, ...] = ()
        self.views: tuple[InstanceView, ...] = ()
        self.ledger_down = False  # a shared outage: failures say nothing about the instance
        self.on_open: Callable[[str], None] | None = None  # a breaker opened (Discovery: is the ledger down?)
        self.left_out: tuple[LeftOut, ...] = ()  # registry records Discovery refused, said in no-pair errors
        # The clock-free candidate lists (see the module docstring); None: test instance by instance.
        self._fast_p: dict[str, list[LiveInstance] | None] = {}
        self._fast_d: dict[int, list[LiveInstance] | None] = {}
        self._fast_w: dict[str, list[LiveInstance] | None] = {}  # model -> both sides, for whole requests
        self._public_key = os.urandom(16)  # names instances to clients (`public_name`); see `key_public_names`

    def key_public_names(self, secret: bytes | None) -> None:
        """Name instances under a key derived from `secret` (the router's claim key, from the admin token),
        so that every worker and replica holding that token gives an instance the same name; without
        one the names are this process's own. Called before the first snapshot."""
        if secret is not None:
            self._public_key = hmac.new(secret, b"pdgate public instance names", hashlib.sha256).digest()

    def public_name(self, instance_id: str) -> str:
        """The opaque name a client reads for an instance: `#` and a keyed hash of its id. Instance ids
        default to `<host>-<port>`, and an engine's address lets a caller bypass the router's keys, so
        client-facing errors and the open `/health` never show one (SECURITY.md); the admin `/health`
        and the log pair each id with this name. Stable while the key is (`key_public_names`)."""
        return "#" + hmac.new(self._public_key, instance_id.encode(), hashlib.sha256).hexdigest()[:10]

    # -- refresh ----------------------------------------------------------------------------

    def replace(self, views: Iterable[InstanceView]) -> None:
        """Install a new snapshot. LiveInstances of ids still present keep their counts and breakers."""
        views = tuple(sorted(views, key=lambda v: v.id))
        instances: dict[str, LiveInstance] = {}
        for v in views:
            inst = self.instances.get(v.id)
            if inst is None:
                inst = LiveInstance(
                    v, CircuitBreaker(self._breaker_cfg, self._transition_cb(v.id)), self.public_name(v.id)
                )
            else:
                was = inst.view
                if v.reported_at != was.reported_at or v.reported != was.reported:  # a new report
                    inst.own_at_report = inst.peak  # see `LiveInstance.others`
                    inst.peak = inst.requests
                inst.view = v
            instances[v.id] = inst
        for gone in self.instances.keys() - instances.keys():
            old = self.instances[gone]
            old.requests = 0
            old.tokens = 0
            if self._on_inflight is not None:
                self._on_inflight(old)
        self.instances = instances
        self.views = views
        by_url: dict[str, list[LiveInstance]] = {}
        for inst in instances.values():
            by_url.setdefault(inst.view.url, []).append(inst)
        self._by_url = by_url
        fingerprint = tuple((v.id, v.role, v.draining, v.compat_key) for v in views)
        if fingerprint != self._fingerprint:  # same ids and fields: the lists already hold these instances
            self._fingerprint = fingerprint
            self._rebuild()
        self._invalidate()

    def _invalidate(self) -> None:
        """Something a candidate list depends on changed: a snapshot, a health verdict, a breaker."""
        self._fast_p.clear()
        self._fast_d.clear()
        self._fast_w.clear()

    def _transition_cb(self, instance_id: str) -> Callable[[BreakerState, BreakerState], None]:
        def cb(before: BreakerState, to: BreakerState) -> None:
            self._invalidate()
            if self._on_breaker is not None:
                self._on_breaker(instance_id, to)
            if to is BreakerState.OPEN and self.on_open is not None:
                self.on_open(instance_id)

        return cb

    def _rebuild(self) -> None:
        """Group by model and compat class, then pair classes (see the module docstring)."""
        prefills: dict[str, list[LiveInstance]] = {}
        decodes: dict[str, list[LiveInstance]] = {}
        class_of: dict[tuple[object, ...], int] = {}
        p_classes: dict[int, InstanceView] = {}  # class -> a representative view
        d_classes: dict[str, dict[int, InstanceView]] = {}  # model -> class -> representative
        for inst in self.instances.values():  # sorted by id (replace sorts), so every list below is too
            v = inst.view
            inst.compat = class_of.setdefault(v.compat_key, len(class_of))
            if v.model is None:
                continue
            if v.role.can_prefill():
                prefills.setdefault(v.model, []).append(inst)
                p_classes.setdefault(inst.compat, v)
            if v.role.can_decode():
                decodes.setdefault(v.model, []).append(inst)
                d_classes.setdefault(v.model, {}).setdefault(inst.compat, v)
        compatible: dict[int, list[LiveInstance]] = {}
        for key, p in p_classes.items():
            assert p.model is not None
            ok = {dk for dk, d in d_classes.get(p.model, {}).items() if compatible_views(p, d)}
            compatible[key] = [d for d in decodes.get(p.model, ()) if d.compat in ok] if ok else []
        self.prefills = prefills
        self.decodes = decodes
        self._compatible = compatible

    # -- selection --------------------------------------------------------------------------

    def prefill_candidates(self, model: str, now: float, exclude: Sequence[str] = ()) -> list[LiveInstance]:
        fast = self._fast_p.get(model, _UNBUILT)
        if fast is _UNBUILT:
            fast = self._fast_p[model] = self._fast_prefills(model)
        if fast is not None:
            return [p for p in fast if p.id not in exclude] if exclude else fast.copy()
        served: dict[int, bool] = {}  # prefill class -> has an eligible decode now
        out = []
        for p in self.prefills.get(model, ()):
            if p.id in exclude or p.unavailable(now) is not None:
                continue
            key = p.compat
            ok = served.get(key)
            if ok is None:
                ok = served[key] = any(d.unavailable(now) is None for d in self._compatible.get(key, ()))
            if ok:
                out.append(p)
        return out

    def decode_candidates(self, prefill: LiveInstance, now: float, exclude: Sequence[str] = ()) -> list[LiveInstance]:
        """Decodes that can take `prefill`'s KV now. A prefill that left the snapshot while its request
        was in flight (its lease lapsed under load, or it was drained) still has its KV: pair it afresh."""
        compatible = self._compatible.get(prefill.compat)
        if compatible is None or self.instances.get(prefill.id) is not prefill:
            model = prefill.view.model
            pool = self.decodes.get(model, ()) if model is not None else ()
            compatible = [d for d in pool if incompatibility(prefill.view, d.view) is None]
        else:
            fast = self._fast_decodes(prefill.compat)
            if fast is not None:
                return [d for d in fast if d.id not in exclude] if exclude else fast.copy()
        return [d for d in compatible if d.id not in exclude and d.unavailable(now) is None]

    def _fast_prefills(self, model: str) -> list[LiveInstance] | None:
        """The prefill candidates of `model` while no instance they depend on has a clock-bound breaker."""
        settled = _settled(self.prefills.get(model, ()))
        if settled is None:
            return None
        served: dict[int, bool] = {}
        out = []
        for p in settled:
            ok = served.get(p.compat)
            if ok is None:
                decodes = self._fast_decodes(p.compat)
                if decodes is None:
                    return None
                ok = served[p.compat] = bool(decodes)
            if ok:
                out.append(p)
        return out

    def _fast_decodes(self, key: int) -> list[LiveInstance] | None:
        """The decodes of prefill class `key` in rotation whatever the time (None: test them at `now`)."""
        fast = self._fast_d.get(key, _UNBUILT)
        if fast is _UNBUILT:
            fast = self._fast_d[key] = _settled(self._compatible.get(key, ()))
        return fast

    def whole_candidates(
        self, model: str, now: float, exclude: Sequence[str] = (), *, either: bool = False
    ) -> list[LiveInstance]:
        """Instances that can serve a request of `model` end to end now (`whole`): the decodes (role decode
        or both), and only when none is live the prefills. Every engine of a PD deployment computes a
        prompt that comes with no remote KV; a decode's memory is sized for the generation. `either`: the
        decodes and the prefills together (the decider's whole requests, `--whole-on any`), each once."""
        if either:
            if not exclude:
                fast = self._fast_w.get(model, _UNBUILT)
                if fast is _UNBUILT:
                    fast = self._fast_w[model] = _settled(self._either_side(model))
                if fast is not None:
                    return fast.copy()
            return [i for i in self._either_side(model) if i.id not in exclude and i.unavailable(now) is None]
        for side in (self.decodes, self.prefills):
            out = [i for i in side.get(model, ()) if i.id not in exclude and i.unavailable(now) is None]
            if out:
                return out
        return []

    def _either_side(self, model: str) -> list[LiveInstance]:
        """The decodes, then the prefills of `model`, an instance of role both (on both sides) once."""
        seen: dict[str, LiveInstance] = {}
        for side in (self.decodes, self.prefills):
            for i in side.get(model, ()):
                seen.setdefault(i.id, i)
        return list(seen.values())

    def models(self, now: float) -> list[str]:
        """Models that have at least one eligible, compatible prefill/decode pair now."""
        return sorted(m for m in self.prefills if self.prefill_candidates(m, now))

    def known_models(self) -> list[str]:
        return sorted(set(self.prefills) | set(self.decodes))

    def explain(self, model: str, now: float, *, public: bool = False) -> str:
        """Why no pair serves `model` now; `public`: naming each instance by role and opaque name, as a
        client may read it (the error's message, the open `/health`), else by id (the log, the admin)."""
        if public:
            views = [replace_view(i.view, id=f"{_role(i.view)} {i.public}") for i in self.instances.values()]
        else:
            views = [inst.view for inst in self.instances.values()]
        down = [(views[n], why) for n, inst in enumerate(self.instances.values()) if (why := inst.unavailable(now))]
        why = explain(
            model,
            [v for v in views if v.role.can_prefill() and not v.draining],
            [v for v in views if v.role.can_decode() and not v.draining],
            down,
        )
        said = left_out_said(self.left_out, model, full=not public)
        return why if said is None else f"{why}; {said}"

    # -- accounting -------------------------------------------------------------------------

    def lease(self, inst: LiveInstance, tokens: int, clock: Callable[[], float]) -> Lease:
        """Count one request against `inst` until the returned `Lease` is exited (use it as `with`)."""
        inst.requests += 1
        if inst.requests > inst.peak:
            inst.peak = inst.requests
        inst.tokens += tokens
        seq = inst.breaker.on_dispatch(clock())
        if self._on_inflight is not None:
            self._on_inflight(inst)
        return Lease(self, inst, tokens, clock, seq)

    def _release(self, inst: LiveInstance, tokens: int) -> None:
        if inst.requests > 0:
            inst.requests -= 1
            inst.tokens = max(0, inst.tokens - tokens)
        if self._on_inflight is not None:
            self._on_inflight(inst)

    def ledger_outage(self, since: float) -> list[str]:
        """The ledger is unreachable (noticed now, possibly down since `since`): no breaker verdicts
        until `ledger_back`, and breakers that opened since `since` are closed. Returns their ids."""
        self.ledger_down = True
        return [inst.id for inst in self.instances.values() if inst.breaker.forgive(since)]

    def ledger_back(self) -> None:
        self.ledger_down = False

    def set_health(self, url: str, ok: bool, reason: str = "") -> None:
        for inst in self._by_url.get(url, ()):
            if inst.healthy is not ok:
                self._invalidate()
            inst.healthy = ok
            inst.health_reason = reason

    def urls(self) -> list[str]:
        return sorted({v.url for v in self.views})

    def counts(self, now: float) -> dict[tuple[str, str], int]:
        """(role, available|unavailable) -> number of instances, for the gauge."""
        out: dict[tuple[str, str], int] = {}
        for inst in self.instances.values():
            key = (inst.view.role.value, "available" if inst.unavailable(now) is None else "unavailable")
            out[key] = out.get(key, 0) + 1
        for role in Role:
            for status in ("available", "unavailable"):
                out.setdefault((role.value, status), 0)
        return out


_UNBUILT: list[LiveInstance] = []  # a sentinel: the candidate list of this key is not built since the last change


def _settled(instances: Iterable[LiveInstance]) -> list[LiveInstance] | None:
    """The instances in rotation whatever the time, or None when one of them depends on the clock.

    Draining, unhealthy and model-less instances are out until a refresh or a health verdict (both call
    `_invalidate`); a closed breaker lets every request through; an open or half-open one decides by
    `now` and by its probe, so a list holding its instance could not be kept."""
    out = []
    for inst in instances:
        v = inst.view
        if v.draining or v.model is None or not inst.healthy:
            continue
        if not inst.breaker.closed:
            return None
        out.append(inst)
    return out


class Lease:
    """One request counted against one instance, from `Pool.lease` to the end of the `with` block.

    The holder says how the instance did (`succeeded()` / `failed()`); on exit the count is released
    and the verdict, if any, goes to the instance's breaker. No verdict (a cancelled request, the
    client's own 4xx...) leaves the breaker alone.
    """

    __slots__ = ("_clock", "_pool", "_seq", "instance", "ok", "tokens")

    def __init__(
        self, pool: Pool, instance: LiveInstance, tokens: int, clock: Callable[[], float], seq: int | None = None
    ) -> None:
        self._pool = pool
        self._seq = seq  # the breaker's number for this request: failures of one burst count once
        self.instance = instance
        self.tokens = tokens
        self._clock = clock
        self.ok: bool | None = None

    def succeeded(self) -> None:
        self.ok = True

    def failed(self) -> None:
        self.ok = False

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        inst = self.instance
        self._pool._release(inst, self.tokens)
        if self.ok is True:
            inst.breaker.record_success(self._clock())
        elif self.ok is False and not self._pool.ledger_down:
            inst.breaker.record_failure(self._clock(), self._seq)


def _role(view: InstanceView) -> str:
    return "instance" if view.role is Role.BOTH else view.role.value

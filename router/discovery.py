"""Background I/O that keeps the pool current: registry refresh, static instances, active health checks.

Why background: the registry is read every `refresh_interval_s`, never per request, so a slow or
unreachable metaserver never adds latency to a request (the last snapshot stays in use). Static
instances (`--prefill URL`, `--decode URL`) learn their model from `GET /v1/models` unless `--model`
names it; their other compatibility fields are unknown, i.e. wildcards. An instance that is both in
the registry and static is taken from the registry (it says more).

Health: every `health_interval_s`, `GET /health` of each distinct URL (DP ranks share one); an instance
that fails it gets no new work until a probe passes again. This catches an engine whose API server is
wedged while its connector still heartbeats, and a static instance that died. A probe that is refused or
answers an error fails at once (the engine is gone or says it is sick); a probe that only times out fails
the instance after `health_timeouts_to_fail` timeouts in a row, because a vLLM API server busy with a
burst of requests can answer /health late while it serves them well, and taking the one decode of a pair
out for one slow answer turns a busy moment into 503s for everyone.

One instance can never stop the others: whatever goes wrong while probing it (any exception, not only
the upstream errors) is that instance's failed check, and a registry record whose URL breaks the URL
rule (`pdgate.urls`; a record written before the rule, or straight into the store), or that
is this router's own address (possible with an external metaserver), is left out of the pool with a
warning. So a bad record can neither stop the health loop nor fail start-up.
Reasons kept for `/health` name the failure, never an address; the log line has the details.
The records left out at the last read are kept too (`Pool.left_out`, `LeftOut`), so that a pool that
is empty because of them says so: an engine outside `--allowed-engine-networks` used to look like no
engine at all to the client and in `/health` (issue #26), with the reason only in the router's log.
`unpooled` words it: the count and the reason for anyone, the ids and URLs for the admin.

An outage of the registry is not a death of its instances: while the metaserver or its store cannot be
read, engines cannot heartbeat either, so right after it comes back their records may have lapsed (a
store restarted empty, or one restored from its AOF with stale heartbeats) until their next heartbeat
re-registers them. An instance missing from the first reads after an outage therefore stays in the pool
for its own lease (plus one refresh) from the moment the registry came back: the health checks keep
judging it, the ledger works again, and requests keep flowing instead of failing with
`pd_no_compatible_pair`. Absent longer than that, or absent while the registry was readable all along, it
is gone. A failed read that says the metaserver or its store is unreachable also tells the pool that the
ledger is down (`Pool.ledger_outage`), so that the failures it causes open no instance's breaker. The
outage is often first seen as breakers opening (every decode's claim fails at once): so an opening
breaker triggers one registry read at once, instead of waiting for the next refresh, and breakers the
outage opened are closed again before the router refuses work for them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from pdgate.router.left_out import LeftOut
from pdgate.router.loops import is_own_address
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pairing import InstanceView
from pdgate.router.pool import Pool
from pdgate.router.settings import RouterSettings

from pdgate.meta_client import MetaAPI, MetaBadRequest, MetaError, MetaUnauthorized, MetaUnavailable
from pdgate.models import Role
from pdgate.upstream import ConnectFailed, ReadTimeout, Upstream, UpstreamError
from pdgate.urls import InvalidEngineURL, check_engine_url, static_instance_id

__all__ = ["Discovery"]

log = logging.getLogger(__name__)


class Discovery:
    def __init__(
        self,
        settings: RouterSettings,
        pool: Pool,
        meta: Callable[[], MetaAPI],
        upstream: Callable[[], Upstream],
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._s = settings
        self._pool = pool
        self._meta = meta
        self._upstream = upstream
        self._m = metrics
        self._clock = clock
        roles: dict[str, Role] = {}
        for url in settings.prefill:
            roles[url] = Role.PREFILL
        for url in settings.decode:
            roles[url] = Role.BOTH if roles.get(url) is Role.PREFILL else Role.DECODE
        self._static_roles = roles
        self._timeouts: dict[str, int] = {}  # url -> health probes timed out in a row
        self._static_models: dict[str, str | None] = {url: settings.model for url in roles}
        self._registry: list[InstanceView] = []
        self._leases: dict[str, float] = {}  # instance id -> its registry lease (s), for the outage grace
        self._recovered_at: float | None = None  # when the registry became readable after its last outage
        self._said_kept = False
        self._last_ok = clock()  # the last good registry read
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._check: asyncio.Task[None] | None = None  # a registry read triggered by an opening breaker
        pool.on_open = self._breaker_opened
        self._networks = settings.engine_networks
        self._own = (settings.host, settings.port) if settings.port else None  # this router's socket
        self._refused: set[str] = set()  # registry URLs already warned about
        self.registry_error: str | None = None  # why the last registry read failed (for operators)
        self.registry_reason: str | None = None  # the same, without addresses (for anyone)

    # -- one round of each --------------------------------------------------------------------

    async def refresh_once(self) -> None:
        try:
            # Bounded by the client's own timeout (metaserver_timeout_s, or the store's socket timeouts),
            # not by asyncio.wait_for: on Python < 3.12 wait_for swallows a cancellation that races with
            # its result, and this loop would then outlive the router's shutdown.
            instances = await self._meta().list_instances()
        except Exception as exc:
            detail = exc.detail if isinstance(exc, MetaError) else f"{type(exc).__name__}: {exc}"
            if self.registry_error is None:
                log.warning("registry refresh failed (keeping the last snapshot): %s: %s", _reason(exc), detail)
            self.registry_error = detail
            self.registry_reason = _reason(exc)
            self._recovered_at = None
            if isinstance(exc, MetaUnavailable):  # the ledger is down too: no instance is to blame
                forgiven = self._pool.ledger_outage(since=self._last_ok)  # failures since may be the outage's
                if forgiven:
                    log.info("closed the breakers of %s: they opened while the ledger was down", ", ".join(forgiven))
        else:
            now = self._clock()
            self._last_ok = now
            self._pool.ledger_back()
            if self.registry_error is not None:
                log.info("registry refresh works again")
                self._recovered_at = now
                self._said_kept = False
            self.registry_error = self.registry_reason = None
            views = [self._view(i) for i in instances]
            fresh = [v for v in views if isinstance(v, InstanceView)]
            self._pool.left_out = tuple(v for v in views if isinstance(v, LeftOut))
            self._registry = fresh + self._kept_through_outage(fresh, now)
            for inst in instances:
                self._leases[inst.id] = inst.lease_s
        await self._learn_static_models()
        self._install()

    def _breaker_opened(self, instance_id: str) -> None:
        """Is it the ledger? Read the registry now (one read at a time; only while the loops run)."""
        if self._stopping or not self._tasks or (self._check is not None and not self._check.done()):
            return
        try:
            self._check = asyncio.get_running_loop().create_task(self.refresh_once(), name="pdgate-ledger-check")
        except RuntimeError:  # no running loop (a unit test driving the pool by hand)
            return
        self._check.add_done_callback(_log_failure)

    def _kept_through_outage(self, fresh: list[InstanceView], now: float) -> list[InstanceView]:
        """Instances of the last snapshot that the registry no longer lists, still inside the grace after
        an outage (see the module docstring); the rest are gone, and so is their lease."""
        listed = {v.id for v in fresh}
        kept: list[InstanceView] = []
        for v in self._registry:
            if v.id in listed:
                continue
            lease = self._leases.get(v.id, 0.0)
            if self._recovered_at is not None and now <= self._recovered_at + lease + self._s.refresh_interval_s:
                kept.append(v)
            else:
                self._leases.pop(v.id, None)
        if kept and not self._said_kept:
            self._said_kept = True
            log.info(
                "registry lists %d instance(s) fewer right after an outage; keeping them while they re-register",
                len(kept),
            )
        return kept

    def _view(self, inst: Any) -> InstanceView | LeftOut:
        """The pool's view of a registry record, or why it is left out (logged once) when its URL breaks
        the rule or is this router's own."""
        own = False
        try:
            check_engine_url(inst.url, self._networks)
            if own := is_own_address(inst.url, self._own):
                raise ValueError("it is this router's own address (a forwarding loop)")
            return InstanceView.from_instance(inst)
        except Exception as exc:
            iid, url = str(getattr(inst, "id", "?")), str(getattr(inst, "url", "?"))
            key = f"{iid} {url}"
            if key not in self._refused:
                self._refused.add(key)
                log.warning("registry record %s left out of the pool: %s", key, exc)
            model = getattr(inst, "model", None)
            why = _OWN if own else self._why_refused(url, exc)
            return LeftOut(iid, url, model if isinstance(model, str) else None, why)

    def _why_refused(self, url: str, exc: Exception) -> str:
        """`LeftOut.why` of a record the URL rule refused: the networks' refusal is told apart (the same
        URL passes without them) because it is the one an operator sets, and gets wrong, on purpose."""
        if not isinstance(exc, InvalidEngineURL):
            return "its record cannot be read"
        if not self._networks:
            return "its URL breaks the engine URL rule"
        try:
            check_engine_url(url)
        except InvalidEngineURL:
            return "its URL breaks the engine URL rule"
        try:
            ipaddress.ip_address((urlsplit(url).hostname or "").split("%", 1)[0])
        except ValueError:
            return "a host name, where --allowed-engine-networks needs a literal address"
        return _OUTSIDE

    def _install(self) -> None:
        registry_urls = {v.url for v in self._registry}
        views = list(self._registry)
        for url, role in self._static_roles.items():
            if url in registry_urls:
                continue
            views.append(
                InstanceView(
                    id=static_instance_id(url),
                    role=role,
                    url=url,
                    model=self._static_models.get(url),
                    block_size=self._s.block_size,
                    static=True,
                )
            )
        self._pool.replace(views)
        for (role_name, status), n in self._pool.counts(self._clock()).items():
            self._m.instances.labels(role_name, status).set(n)

    async def _learn_static_models(self) -> None:
        unknown = [url for url, model in self._static_models.items() if model is None]
        if unknown:
            models = await asyncio.gather(*(self._fetch_model(url) for url in unknown))
            for url, model in zip(unknown, models, strict=True):
                if model is not None:
                    log.info("static instance %s serves model %s", url, model)
                    self._static_models[url] = model

    async def _fetch_model(self, url: str) -> str | None:
        try:
            resp = await self._upstream().request("GET", url + "/v1/models", [], b"", timeout=self._s.health_timeout_s)
            data = await resp.read(timeout=self._s.health_timeout_s, limit=1 << 20)
            if resp.status != 200:
                return None
            first = orjson.loads(data)["data"][0]["id"]
            return first if isinstance(first, str) else None
        except Exception as exc:
            log.debug("GET %s/v1/models failed: %r", url, exc)
            return None

    async def health_once(self) -> None:
        urls = self._pool.urls()
        if not urls:
            return
        results = await asyncio.gather(*(self._probe(url) for url in urls))
        for url, reason in zip(urls, results, strict=True):
            if reason == _TIMED_OUT:
                slow = self._timeouts[url] = self._timeouts.get(url, 0) + 1
                if slow < self._s.health_timeouts_to_fail:
                    log.info("health check of %s timed out (%d in a row); still in rotation", url, slow)
                    continue
            else:
                self._timeouts.pop(url, None)
            ok = reason is None
            self._m.health_checks.labels("ok" if ok else "failed").inc()
            self._pool.set_health(url, ok, reason or "")
            if not ok:
                log.warning("health check of %s failed: %s", url, reason)

    async def _probe(self, url: str) -> str | None:
        timeout = self._s.health_timeout_s
        try:
            resp = await self._upstream().request("GET", url + "/health", [], b"", timeout=timeout)
            await resp.read(timeout=timeout, limit=1 << 20)
        except Exception as exc:
            log.debug("GET %s/health failed: %r", url, exc)
            return _reason(exc)
        return None if resp.status == 200 else f"GET /health answered {resp.status}"

    # -- loops ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._loop(self.refresh_once, self._s.refresh_interval_s), name="pdgate-refresh"),
            asyncio.create_task(self._loop(self.health_once, self._s.health_interval_s), name="pdgate-health"),
        ]

    async def _loop(self, step: Callable[[], Awaitable[None]], interval: float) -> None:
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                await step()
            except Exception:
                log.exception("background step %s failed", getattr(step, "__name__", step))

    async def stop(self) -> None:
        """Stop both loops. A cancellation that some awaited library call swallowed is sent again
        (the flag ends the loop at its next turn in any case): shutdown never waits on a loop."""
        self._stopping = True
        if self._check is not None:
            self._tasks.append(self._check)
        while pending := [t for t in self._tasks if not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                log.warning("background loop %s ended with %r", task.get_name(), task.exception())
        self._tasks = []


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s failed: %r", task.get_name(), task.exception())


_TIMED_OUT = "timed out"
_OUTSIDE = "outside --allowed-engine-networks"
_OWN = "this router's own address"


def _reason(exc: BaseException) -> str:
    """A failure as /health shows it to anyone: what went wrong, never the address it went wrong at."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ReadTimeout)):
        return _TIMED_OUT
    if isinstance(exc, ConnectFailed):
        return "connection failed"
    if isinstance(exc, UpstreamError):
        return f"request failed ({type(exc).__name__})"
    if isinstance(exc, MetaUnavailable):
        return "the metaserver or its store is unreachable"
    if isinstance(exc, (MetaUnauthorized, MetaBadRequest)):  # `errors.MetaserverMisconfigured`, as /health says it
        return (
            f"the metaserver refused the router ({exc.status} {exc.code.value}): a configuration error, "
            "not an outage (check the router's metaserver token)"
        )
    if isinstance(exc, MetaError):
        return f"the metaserver refused to list the instances ({exc.status} {exc.code})"
    return f"request failed ({type(exc).__name__})"

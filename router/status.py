"""The router's status page (`GET /`, `GET /status`) and its data (`GET /status/data`): for operators
without Prometheus and Grafana.

What it shows: the pool (instances, role, availability, breaker, requests in flight; with the admin
token also each instance's id, URL, reported load, KV use and drain state), the live handoffs by state,
the request rate and TTFT / TPOT percentiles over the last `KEEP * STEP_S` seconds as small charts, and
the typed errors by code (recent and since start). The page is one static HTML file (`status.html`,
package data: inline SVG charts drawn by its own script, no CDN, no build step) that polls the data.

Who sees what: the same rule as `/health` (`health.health_body`): anyone gets the verdict, the pool under
opaque names and the aggregate numbers (the ones `/metrics` shows anyone); the admin token adds what
the admin `/health` adds (ids, URLs) and the registry's load figures. The page sends the token it was
given in its URL fragment (`/status#token=...`, never sent to a server) or its token box.

History: `StatusPage.run` reads the router's own metrics registry every `STEP_S` (no HTTP, no engine
call) and keeps the last `KEEP` readings; a chart point is the difference of two readings
(`pdgate.histo`, the rule `pdgate top` uses too). The live handoff counts come from the embedded
metaserver's store, or from the metaserver's `/metrics` when the router uses a remote one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request, Response
from pdgate.router.access import AdminCheck
from pdgate.router.client_timing import ClientTiming
from pdgate.router.discovery import Discovery
from pdgate.router.health import health_body
from pdgate.router.pool import Pool
from pdgate.router.settings import RouterSettings
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdgate.histo import quantile, window

__all__ = ["KEEP", "STEP_S", "Reading", "StatusPage", "for_router", "install"]

log = logging.getLogger("pdgate.router.status")

STEP_S = 5.0  # one reading every 5 s
KEEP = 180  # 15 minutes of readings
RECENT_S = 300.0  # "recent" errors: the last 5 minutes
_HANDOFF_STATES = ("PENDING", "READY", "CLAIMED")


@dataclass(frozen=True)
class Reading:
    """The router's counters at one time (wall clock, for the charts' axis)."""

    t: float
    requests: float
    errors: dict[str, float]
    ttft: list[tuple[float, float]]
    tpot: list[tuple[float, float]]
    handoffs: dict[str, int] = field(default_factory=dict)


def _buckets(samples: list[tuple[str, dict[str, str], float]], name: str) -> list[tuple[float, float]]:
    return sorted((float(lb["le"]), v) for n, lb, v in samples if n == name)


class StatusPage:
    """The readings and the page's data. `meta_metrics`: the remote metaserver's /metrics URL (None when
    embedded: `svc` gives its store)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pool: Pool,
        discovery: Discovery,
        clock: Callable[[], float],
        *,
        svc: Callable[[], Any],
        meta_metrics: str | None = None,
        meta_token: str | None = None,
    ) -> None:
        self.registry = registry
        self.timing = ClientTiming(registry)
        self.pool = pool
        self.discovery = discovery
        self.clock = clock
        self._svc = svc
        self._meta_metrics = meta_metrics
        self._meta_headers = {"Authorization": f"Bearer {meta_token}"} if meta_token else {}
        self.readings: deque[Reading] = deque(maxlen=KEEP)
        self._handoffs: dict[str, int] = {}
        self._handoffs_at = float("-inf")
        # Built once: httpx builds a TLS context (the CA bundle read and parsed) for every client, which
        # every STEP_S cost the router as much CPU as a few dozen requests (issue #25).
        self._tls: ssl.SSLContext | None = None
        self._task: asyncio.Task[None] | None = None

    # -- readings ---------------------------------------------------------------------------
    def read(self, t: float | None = None) -> Reading:
        samples = [(s.name, s.labels, s.value) for fam in self.registry.collect() for s in fam.samples]
        return Reading(
            t=time.time() if t is None else t,
            requests=sum(v for n, _, v in samples if n == "pdgate_router_requests_total"),
            errors={lb["code"]: v for n, lb, v in samples if n == "pdgate_router_errors_total"},
            ttft=_buckets(samples, "pdgate_router_ttft_seconds_bucket"),
            tpot=_buckets(samples, "pdgate_router_tpot_seconds_bucket"),
            handoffs=dict(self._handoffs),
        )

    async def read_handoffs(self, max_age_s: float = 0.0) -> None:
        """The live handoffs by state, from the embedded store or the metaserver's /metrics, unless read
        less than `max_age_s` ago; kept as they were when neither answers."""
        if max_age_s and self.clock() - self._handoffs_at < max_age_s:
            return
        self._handoffs_at = self.clock()
        try:
            svc = self._svc()
            if svc is not None:
                counts = await svc.store.count_handoffs_by_state()
                self._handoffs = {s.value: n for s, n in counts.items()}
            elif self._meta_metrics is not None:
                if self._tls is None:
                    self._tls = httpx.create_ssl_context()
                async with httpx.AsyncClient(timeout=2.0, verify=self._tls) as client:
                    resp = await client.get(self._meta_metrics, headers=self._meta_headers)
                found: dict[str, int] = {}
                for fam in text_string_to_metric_families(resp.text):
                    for s in fam.samples:
                        if s.name == "pdgate_metaserver_handoffs" and "state" in s.labels:
                            found[s.labels["state"]] = int(s.value)
                self._handoffs = found
        except Exception as exc:  # the page must not fail with the ledger: the counts stay as they were
            log.debug("handoff counts not read: %s", exc)

    async def run(self) -> None:
        while True:
            await self.read_handoffs()
            self.readings.append(self.read())
            await asyncio.sleep(STEP_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="pdgate-status-readings")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the page's data --------------------------------------------------------------------
    def series(self, now: Reading) -> list[dict[str, Any]]:
        """One chart point per pair of consecutive readings (the last pair ends now)."""
        points = []
        seq = [*self.readings, now]
        for old, new in itertools.pairwise(seq):
            dt = new.t - old.t
            if dt <= 0:
                continue
            ttft, tpot = window(new.ttft, old.ttft), window(new.tpot, old.tpot)
            points.append(
                {
                    "t": round(new.t, 3),
                    "rps": max(0.0, new.requests - old.requests) / dt,
                    "ttft_p50": quantile(0.5, ttft),
                    "ttft_p95": quantile(0.95, ttft),
                    "tpot_p50": quantile(0.5, tpot),
                    "tpot_p95": quantile(0.95, tpot),
                }
            )
        return points

    def data(self, full: bool) -> dict[str, Any]:
        now_t = self.clock()
        status, health = health_body(self.pool, self.discovery, now_t, full=full)
        if full:
            views = {i.id: i.view for i in self.pool.instances.values()}
            for row in health["instances"]:
                v = views.get(row["id"])
                if v is not None:
                    row.update(load=v.reported, kv_usage=v.kv_usage, draining=v.draining)
        now = self.read()
        recent_base = next((r for r in self.readings if now.t - r.t <= RECENT_S), None)
        recent = {
            code: n - (recent_base.errors.get(code, 0.0) if recent_base else 0.0) for code, n in now.errors.items()
        }
        return {
            "status": health["status"],
            "reason": health["reason"],
            "admin": full,
            "instances": health["instances"],
            "handoffs": {s: now.handoffs.get(s, 0) for s in _HANDOFF_STATES},
            "totals": {
                "requests": now.requests,
                "ttft_count": now.ttft[-1][1] if now.ttft else 0.0,
                "tpot_count": now.tpot[-1][1] if now.tpot else 0.0,
                "ttft_p50": quantile(0.5, now.ttft),
                "ttft_p95": quantile(0.95, now.ttft),
                "tpot_p50": quantile(0.5, now.tpot),
                "tpot_p95": quantile(0.95, now.tpot),
            },
            "errors": [
                {"code": c, "total": n, "recent": recent.get(c, 0.0)} for c, n in sorted(now.errors.items()) if n > 0
            ],
            "series": self.series(now),
            "step_s": STEP_S,
            "http_status": status,
        }


def for_router(
    s: RouterSettings,
    registry: CollectorRegistry,
    pool: Pool,
    discovery: Discovery,
    clock: Callable[[], float],
    holder: dict[str, Any],
) -> StatusPage:
    """The router's page: handoffs from the embedded store (`holder["svc"]`) or the --metaserver's /metrics."""
    remote = f"{s.metaserver.rstrip('/')}/metrics" if s.metaserver else None
    return StatusPage(
        registry, pool, discovery, clock, svc=lambda: holder.get("svc"), meta_metrics=remote,
        meta_token=s.metaserver_token,
    )  # fmt: skip


def page_html() -> bytes:
    return resources.files("pdgate.router").joinpath("status.html").read_bytes()


# The page runs only its own inline script and talks only to this router; no other site may frame it
# (an instance id or model name is an engine's own words: the script escapes them, and this is the net).
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
}


def install(api: FastAPI, page: StatusPage, admin: AdminCheck) -> None:
    """`GET /` and `GET /status` (the page, to anyone: it holds no data) and `GET /status/data`."""
    html = page_html()

    async def show() -> Response:
        return Response(html, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    api.add_api_route("/", show, methods=["GET"], tags=["ops"], response_class=Response, include_in_schema=False)
    api.add_api_route("/status", show, methods=["GET"], tags=["ops"], response_class=Response)

    @api.get("/status/data", tags=["ops"], response_class=Response)
    async def status_data(request: Request) -> Response:
        peer = request.client.host if request.client is not None else None
        full = admin.holds(request.headers.get("authorization"), peer)
        await page.read_handoffs(max_age_s=1.0)  # live counts, read at most once a second for all viewers
        return Response(orjson.dumps(page.data(full)), media_type="application/json")

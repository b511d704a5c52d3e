"""Every Prometheus metric of the metaserver, defined once (prefix `pdgate_metaserver_`).

Metrics live on a `CollectorRegistry` passed in, not the global one: several apps in one test process,
or the router mounting the metaserver in-process, each get their own (or share the router's on purpose).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdgate.metaserver.store.base import Store
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["PREFIX", "MetaMetrics"]

log = logging.getLogger(__name__)

PREFIX = "pdgate_metaserver_"

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MetaMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.handoffs_created = Counter(
            PREFIX + "handoffs_created_total", "Handoffs created (entered PENDING)", registry=r
        )
        self.transitions = Counter(
            PREFIX + "handoff_transitions_total",
            "Handoff state transitions, by source and target state",
            ["from_state", "to_state"],
            registry=r,
        )
        self.lease_expiries = Counter(
            PREFIX + "lease_expiries_total",
            "Handoff leases that lapsed (sweeper), by the state whose lease lapsed and the state it led to",
            ["from_state", "to_state"],
            registry=r,
        )
        self.registry_size = Gauge(
            PREFIX + "registry_instances", "Live instances in the registry (refreshed by the sweeper)", registry=r
        )
        self.request_latency = Histogram(
            PREFIX + "request_seconds",
            "Request latency per route template",
            ["method", "route", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_errors = Counter(
            PREFIX + "store_errors_total", "Store calls that failed (store unreachable or broken)", ["kind"], registry=r
        )
        self.sweeps = Counter(PREFIX + "sweeps_total", "Sweeper passes", registry=r)
        self.handoffs = Gauge(
            PREFIX + "handoffs",
            "Live (non-terminal) handoff records in the store, by state (read from the store at scrape time)",
            ["state"],
            registry=r,
        )

        self.batch_items = Histogram(
            PREFIX + "batch_items",
            "Items per POST /v1/handoffs/batch (how much the callers' batching saves)",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_outcomes = Counter(
            PREFIX + "batch_item_outcomes_total",
            "Batch items answered, by operation and the status its single route would have answered",
            ["op", "status"],
            registry=r,
        )
        self._outcome_children: dict[tuple[str, int], Counter] = {}

    def observe_batch(self, items: Sequence[object], outcomes: Sequence[object]) -> None:
        """Count one batch: its size, and each item's operation and status (`batch.run_batch` calls it)."""
        self.batch_items.observe(len(items))
        for item, outcome in zip(items, outcomes, strict=True):
            op = str(getattr(item, "op", "invalid"))
            status = int(getattr(outcome, "status", 201 if op == "create" else 200))
            child = self._outcome_children.get((op, status))
            if child is None:
                child = self._outcome_children[(op, status)] = self.batch_outcomes.labels(op, str(status))
            child.inc()

    async def refresh_from_store(self, store: Store) -> None:
        """Read the store-wide gauges just before a scrape renders them.

        Why at scrape time and from the store: replicas on one Redis then report the same numbers, and no
        process keeps a copy that drifts. A store that cannot answer must not fail the scrape (the other
        metrics still matter most then): the gauge keeps its last value and the error is counted."""
        try:
            counts = await store.count_handoffs_by_state()
        except Exception as exc:
            self.store_errors.labels("metrics").inc()
            log.warning("handoffs by state not refreshed: %s", exc)
            return
        for state, n in counts.items():
            self.handoffs.labels(state.value).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

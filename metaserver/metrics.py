"""Every Prometheus metric of the metaserver, defined once (prefix `pdgate_metaserver_`).

Metrics live on a `CollectorRegistry` passed in, not the global one: several apps in one test process,
or the router mounting the metaserver in-process, each get their own (or share the router's on purpose).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["PREFIX", "MetaMetrics"]

PREFIX = "pdgate_metaserver_"

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

    def render(self) -> bytes:
        return generate_latest(self.registry)

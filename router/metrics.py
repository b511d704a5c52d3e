"""Every Prometheus metric of the router, defined once (prefix `pdgate_router_`).

One `RouterMetrics` per app, on its own `CollectorRegistry` (tests build several apps in one process).
Phases of a request, each its own histogram so each gets buckets that fit it:
  overhead   time the router itself spent before the first byte reached the client (total minus the
             waits below): what a PD router adds to TTFT
  handoff    recording the handoff in the metaserver (create)
  prefill    prefill request sent -> prefill answer read
  decode_ttft decode request sent -> first body byte from decode (covers the KV pull on decode)
  e2e        request received -> last byte sent
"""

from __future__ import annotations

from collections.abc import Iterator

from pdgate.router.breaker import BreakerState
from pdgate.router.decider import PATH_REASONS
from pdgate.router.kv_index import KVIndex, Outcome
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LABEL_CODE", "LABEL_INSTANCE", "LABEL_ROLE", "LABEL_SIDE", "RouterMetrics"]

LABEL_CODE = "code"
LABEL_INSTANCE = "instance"
LABEL_ROLE = "role"
LABEL_SIDE = "side"

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdgate_router_requests", "Requests finished, by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.errors = Counter("pdgate_router_errors", "Typed errors sent to clients, by code", [LABEL_CODE], registry=r)
        self.retries = Counter(
            "pdgate_router_retries", "Retries on another instance, by side", [LABEL_SIDE], registry=r
        )
        self.aborts = Counter(
            "pdgate_router_handoff_aborts", "Handoffs the router aborted, by reason", ["reason"], registry=r
        )
        self.overhead = Histogram(
            "pdgate_router_overhead_seconds", "Router's own time before the first byte", buckets=_FAST, registry=r
        )
        self.handoff = Histogram(
            "pdgate_router_handoff_seconds", "Creating the handoff in the metaserver", buckets=_FAST, registry=r
        )
        self.prefill = Histogram(
            "pdgate_router_prefill_seconds", "Prefill request to answer", buckets=_SLOW, registry=r
        )
        self.decode_ttft = Histogram(
            "pdgate_router_decode_ttft_seconds", "Decode request to its first byte", buckets=_SLOW, registry=r
        )
        self.e2e = Histogram(
            "pdgate_router_e2e_seconds", "Request received to last byte sent", buckets=_SLOW, registry=r
        )
        first_token = Counter(
            "pdgate_router_first_token_from_prefill",
            "Streamed completions asked to take their first token from the prefill, by whether it did",
            ["taken"],
            registry=r,
        )
        self.first_token = (first_token.labels("false"), first_token.labels("true"))  # index: taken
        self.inflight = Gauge("pdgate_router_inflight", "Requests in flight in the router", registry=r)
        self.instance_inflight = Gauge(
            "pdgate_router_instance_inflight",
            "Requests in flight per instance (DP rank)",
            [LABEL_INSTANCE, LABEL_ROLE],
            registry=r,
        )
        self.breaker_state = Gauge(
            "pdgate_router_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            [LABEL_INSTANCE],
            registry=r,
        )
        self.instances = Gauge(
            "pdgate_router_instances", "Instances known, by role and availability", [LABEL_ROLE, "status"], registry=r
        )
        self.health_checks = Counter(
            "pdgate_router_health_checks", "Active health checks, by outcome", ["outcome"], registry=r
        )
        self.trace_dropped = Counter(
            "pdgate_router_trace_context_dropped",
            "Requests whose malformed traceparent/tracestate was not forwarded to the engines",
            registry=r,
        )
        self._paths(r)
        self._error_children: dict[str, Counter] = {}

    def _paths(self, r: CollectorRegistry) -> None:
        """Which path requests took: whole instead of PD, resumed, the decider's choice, the KV index."""
        self.undisaggregated = Counter(
            "pdgate_router_undisaggregated",
            "Requests served end to end on one instance instead of prefill/decode, by reason",
            ["reason"],
            registry=r,
        )
        self.resumes = Counter(
            "pdgate_router_resumes",
            "Streams resumed on another instance, by the error they resumed from",
            ["reason"],
            registry=r,
        )
        decisions = Counter(
            "pdgate_router_decisions",
            "PD or whole per request, by the decider's rule (router/decider.py)",
            ["path", "reason"],
            registry=r,
        )
        self._decisions = {(a.value, b.value): decisions.labels(a.value, b.value) for a, b in PATH_REASONS}
        kv_events = Counter(
            "pdgate_router_kv_event_batches",
            "KV-event batches from the engines, by what the index did (router/kv_index.py Outcome: applied, "
            "duplicate, gap (replay asked), restart, overflow)",
            ["outcome"],
            registry=r,
        )
        self._kv_events = {o.value: kv_events.labels(o.value) for o in Outcome}

    def error(self, code: str) -> None:
        child = self._error_children.get(code)
        if child is None:
            child = self._error_children[code] = self.errors.labels(code)
        child.inc()

    def decision(self, labels: tuple[str, str]) -> None:
        """Count one decision (`Decision.labels`: path, reason)."""
        self._decisions[labels].inc()

    def kv_event_batch(self, _instance: str, outcome: Outcome) -> None:
        """Count one KV-event batch (the subscriber's `on_outcome`)."""
        self._kv_events[outcome.value].inc()

    def follow_index(self, index: KVIndex) -> None:
        """Show, at each scrape, how many blocks the KV-event index holds per instance: what the router
        believes each engine caches (an operator's check that events arrive; a test's wait for them)."""
        self.registry.register(_IndexBlocks(index))

    def set_breaker(self, instance_id: str, state: BreakerState) -> None:
        self.breaker_state.labels(instance_id).set(state.gauge)

    def set_instance_inflight(self, instance_id: str, role: str, value: int) -> None:
        self.instance_inflight.labels(instance_id, role).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IndexBlocks(Collector):
    """`pdgate_router_kv_index_blocks{instance}`, read from the index when scraped (no bookkeeping on the
    event path)."""

    def __init__(self, index: KVIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdgate_router_kv_index_blocks",
            "Blocks the KV-event index holds, per instance (what the engines' events say they cache)",
            labels=[LABEL_INSTANCE],
        )
        for instance in self._index.instances():
            family.add_metric([instance], self._index.size(instance))
        yield family

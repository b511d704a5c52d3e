"""One trace per PD request: the router's span, its phases, and the engines' spans under them.

Without `--otlp-traces-endpoint` the router adds nothing: an incoming W3C `traceparent`/`tracestate`
goes unchanged to both the prefill and the decode (`proxy`), so vLLM's own spans (vLLM exports them
with its `--otlp-traces-endpoint`) join the caller's trace. With it, the router opens a SERVER span
`pdgate.router <route>` (child of the incoming `traceparent`, if any) with one child span per phase,
`pdgate.prefill` and `pdgate.decode`, and each engine request carries the `traceparent` of its phase:
the prefill's and the decode's vLLM spans then hang under the router's phases, and the request reads
as one trace. Exported over OTLP/HTTP in batches, off the request path.

OpenTelemetry is an optional extra (`pip install 'pdgate[tracing]'`), imported only when asked for.

Only a well-formed trace context reaches an engine (`trace_context`): one W3C `traceparent`, and a
`tracestate` within the spec's limits (32 list members, 512 characters) beside it. Why: both headers
went to the engines unchecked, so `garbage; rm -rf /`, a 4 MB value or 500 copies of the header reached
every prefill and decode (with fan-out, one 1 MB header became 128 MB sent to the engines). A malformed
one is dropped and counted (`pdgate_router_trace_context_dropped`); the request then starts a new trace,
as the spec says a receiver does.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["TRACE_HEADERS", "Tracing", "make_tracing", "trace_context"]

TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
TRACESTATE_MEMBERS = 32  # the spec's limits on what a vendor must propagate
TRACESTATE_CHARS = 512

# version-traceid-parentid-flags, lowercase hex; version ff and all-zero ids are invalid (checked below).
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE = b"0" * 32
_ZERO_PARENT = b"0" * 16
# key: simple-key or tenant@system; value: printable ASCII but ',' and '=', not ending in a space.
_TS_MEMBER = re.compile(
    rb"(?:[a-z0-9][a-z0-9_*/-]{0,255}|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})"
    rb"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def trace_context(pairs: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], bool]:
    """What of a request's trace headers (`pairs`, names in `TRACE_HEADERS`) may go to the engines, and
    whether anything was dropped. A malformed or repeated `traceparent` drops the whole context (a
    `tracestate` means nothing without its parent); a malformed or over-long `tracestate` drops itself."""
    parents = [v for k, v in pairs if k == b"traceparent"]
    states = [v for k, v in pairs if k == b"tracestate"]
    if len(parents) != 1 or not _valid_parent(parents[0]):
        return [], True
    kept = [(b"traceparent", parents[0])]
    if not states:
        return kept, False
    state = b",".join(states)  # repeated tracestate headers are one list (RFC 9110 field lines)
    if not _valid_state(state):
        return kept, True
    return [*kept, (b"tracestate", state)], False


def _valid_parent(value: bytes) -> bool:
    return (
        len(value) == 55
        and _TRACEPARENT.fullmatch(value) is not None
        and not value.startswith(b"ff")
        and value[3:35] != _ZERO_TRACE
        and value[36:52] != _ZERO_PARENT
    )


def _valid_state(value: bytes) -> bool:
    if len(value) > TRACESTATE_CHARS:
        return False
    members = [m.strip(b" \t") for m in value.split(b",")]
    members = [m for m in members if m]  # empty members are allowed and carry nothing
    if len(members) > TRACESTATE_MEMBERS:
        return False
    keys: set[bytes] = set()
    for member in members:
        if _TS_MEMBER.fullmatch(member) is None:
            return False
        keys.add(member.partition(b"=")[0])
    return len(keys) == len(members)  # a key appears once


class Tracing:
    """Spans of the router, from a tracer provider (the OTLP one, or a test's)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("pdgate.router")
        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def request(self, route: str, incoming: list[tuple[bytes, bytes]], attributes: dict[str, Any]) -> Iterator[Any]:
        """The router's span of one request, child of the incoming `traceparent` when there is one."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in incoming if k in TRACE_HEADERS}
        parent = self._propagator.extract(carrier)
        with self._tracer.start_as_current_span(
            f"pdgate.router {route}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            try:
                yield span
            except BaseException as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[tuple[Any, list[tuple[bytes, bytes]]]]:
        """A child span of the current one, and the trace headers that make an engine's span its child."""
        with self._tracer.start_as_current_span(f"pdgate.{name}") as span:
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier)
            yield span, [(k.encode(), v.encode()) for k, v in carrier.items()]

    def shutdown(self) -> None:
        """Export what is still queued (at the router's shutdown)."""
        self.provider.shutdown()


def make_tracing(endpoint: str | None) -> Tracing | None:
    """The router's tracing for `--otlp-traces-endpoint` (an OTLP/HTTP collector base URL, e.g.
    http://collector:4318, or the full .../v1/traces URL); None when unset."""
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'pdgate[tracing]'") from exc
    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": "pdgate-router"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return Tracing(provider)

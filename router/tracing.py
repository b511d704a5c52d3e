"""One trace per PD request: the router's span, its phases, and the engines' spans under them.

Without `--otlp-traces-endpoint` the router adds nothing: an incoming W3C `traceparent`/`tracestate`
goes unchanged to both the prefill and the decode (`proxy`), so vLLM's own spans (vLLM exports them
with its `--otlp-traces-endpoint`) join the caller's trace. With it, the router opens a SERVER span
`pdgate.router <route>` (child of the incoming `traceparent`, if any) with one child span per phase,
`pdgate.prefill` and `pdgate.decode`, and each engine request carries the `traceparent` of its phase:
the prefill's and the decode's vLLM spans then hang under the router's phases, and the request reads
as one trace. Exported over OTLP/HTTP in batches, off the request path.

OpenTelemetry is an optional extra (`pip install 'pdgate[tracing]'`), imported only when asked for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["TRACE_HEADERS", "Tracing", "make_tracing"]

TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


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

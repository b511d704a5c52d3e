"""A PD request is one trace (issue 15): the router's span under the caller's, a span per phase, and each
engine request carrying its phase's `traceparent`.

Real parts: the router built from `--otlp-traces-endpoint` exports over OTLP/HTTP (the SDK's exporter,
batched) to an in-process collector that decodes the protobuf it receives; the engine is a pdgate-sim
behind a relay that records the headers that reached it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.integration.router.conftest import HTTP, Deployment
from tests.security.router_support import RecordingEngine
from tests.support.ports import wait_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


class Collector:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf) on a loopback port."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["content-length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
                body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def test_one_pd_request_is_one_trace(collector: Collector) -> None:
    with RecordingEngine("both") as engine:
        d = Deployment(prefill=[engine.url], decode=[engine.url], otlp_traces_endpoint=collector.url)
        with d:
            wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="the static engine")
            r = HTTP.post(
                d.url + "/v1/completions",
                json={"model": "sim-model", "prompt": "trace me", "max_tokens": 2},
                headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
            )
            assert r.status_code == 200
        # the router's shutdown flushed its batch exporter
    by_name = {s.name: s for s in collector.spans}
    router = by_name["pdgate.router /v1/completions"]
    prefill, decode = by_name["pdgate.prefill"], by_name["pdgate.decode"]
    assert {s.trace_id.hex() for s in (router, prefill, decode)} == {TRACE_ID}
    assert router.parent_span_id.hex() == CALLER_SPAN
    assert prefill.parent_span_id == router.span_id and decode.parent_span_id == router.span_id
    attrs = {a.key: a.value for a in router.attributes}
    assert attrs["pdgate.outcome"].string_value == "ok" and attrs["pdgate.transfer_id"].string_value.startswith("pd-")
    # each engine request is the child of its phase
    sent = [h[b"traceparent"].decode().split("-") for h in engine.seen]
    assert [(t[1], t[2]) for t in sent] == [(TRACE_ID, prefill.span_id.hex()), (TRACE_ID, decode.span_id.hex())]


def test_without_tracing_the_callers_traceparent_reaches_both_engines() -> None:
    with RecordingEngine("both") as engine, Deployment(prefill=[engine.url], decode=[engine.url]) as d:
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="the static engine")
        parent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
        r = HTTP.post(
            d.url + "/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"traceparent": parent, "tracestate": "k=v"},
        )
        assert r.status_code == 200
    assert [(h[b"traceparent"], h[b"tracestate"]) for h in engine.seen] == [(parent.encode(), b"k=v")] * 2

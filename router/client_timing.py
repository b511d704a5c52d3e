"""What a client of the router waits for: time to first token (TTFT) and time per output token (TPOT),
measured where the client's bytes leave the router (the proxy routes' ASGI `send`).

Why here and not in the phase histograms (`metrics.py`): those time the router's calls to the engines;
what a user of the status page (`status.py`) asks is how long the answer took to start and how fast it
streamed, retries and fallbacks included. Measured at the ASGI edge, the proxy's code is untouched.

TTFT: request received -> first body bytes of a 200 answer (a whole JSON answer: its only write).
TPOT: for a stream, (closing write - first write) / (SSE events written after the first write, the
closing `[DONE]` and usage tail left out; the closing write follows the last token at once). Events
are counted, not writes, because the router relays what one read of the engine's stream holds, which
is several events when they come fast; a stream whose tokens all came in its first write has no time
between tokens to measure and is not observed.

Cost, measured on this 2-core machine under load: about 2 us per prometheus observe (two per answer,
as the phase histograms already take five) and one more coroutine call per message written.

The two histograms are registered on the router's registry (`RouterMetrics.registry`) so `/metrics` shows
them beside the phase histograms.
"""

from __future__ import annotations

from collections.abc import Awaitable
from time import perf_counter

from prometheus_client import CollectorRegistry, Histogram

from pdgate.asgi import Message, Send

__all__ = ["TPOT_BUCKETS", "TTFT_BUCKETS", "ClientTiming"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ClientTiming:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pdgate_router_ttft_seconds",
            "Request received to the first answer bytes sent to the client (200 answers)",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "pdgate_router_tpot_seconds",
            "Streams: time between token writes to the client, per stream (first to last, closing write left out)",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )

    def wrap(self, send: Send) -> Send:
        """`send` for one proxied request, timing its answer as it goes out. The clock is read twice per
        answer (its first write and its closing one), never per token: this runs for every token."""
        start = perf_counter()
        ok = False
        events = 0  # SSE events written after the first write
        first = 0.0
        ttft, tpot = self.ttft, self.tpot

        def timed(msg: Message) -> Awaitable[None]:  # returns `send`'s awaitable: no coroutine of its own
            nonlocal ok, events, first
            if first:  # the stream's writes after the first: the common case, tested first
                if msg.get("more_body"):
                    events += msg.get("body", b"").count(b"data:")
                elif events and msg["type"] == "http.response.body":
                    tpot.observe((perf_counter() - first) / events)
            elif msg["type"] == "http.response.start":
                ok = msg["status"] == 200
            elif ok and msg["type"] == "http.response.body" and msg.get("body"):
                first = perf_counter()
                ttft.observe(first - start)
            return send(msg)

        return timed

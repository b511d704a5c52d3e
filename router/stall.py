"""How long a decode may take to start streaming before it is left behind (issue #24 item 4).

A decode that stopped (SIGSTOP, a partition, a wedged engine) accepts the request, or never answers its
connection, and says nothing: with a fixed timeout every request sent to it waits the whole timeout before
it is retried. The decodes' first bytes come within a spread the router sees: the time from sending a
streamed decode request to its first chunk (the KV pull and one forward). `FirstByteClock` keeps the
recent ones and gives max(`floor_s`, `factor` x their p99), bounded by the configured timeout: a decode
far slower than its peers ever were is re-sent to another decode (the handoff re-claimed as for any
decode retry) before the client notices much. Until `MIN_SAMPLES` first bytes were seen, and with
`factor` 0, the configured timeout holds. Only streams: a JSON answer's first byte comes when the whole
generation is done.

A request queued behind others on a busy decode is late, not stalled: the bound is per decode and grows
with the requests the router sent that decode before this one that still wait for their first byte
(`waiting`): bound x (1 + those ahead), never past the configured timeout. A decode that stopped is still
left behind at the bound by the first request it holds (nobody is ahead of it). Without this a 256-request
burst on one decode (bench/goodput.py) had 217 requests left behind and resumed whole, at a tenth of the
throughput.
"""

from __future__ import annotations

from collections import deque

__all__ = ["MIN_SAMPLES", "FirstByteClock"]

MIN_SAMPLES = 32  # first bytes seen before the router trusts their spread
_WINDOW = 512  # the recent first bytes kept
_EVERY = 16  # first bytes between two computations of the p99


class FirstByteClock:
    """The recent first-byte latencies of the decodes, and the timeout they give (module doc)."""

    __slots__ = ("_ceiling", "_factor", "_floor", "_limit", "_samples", "_since", "_waiting")

    def __init__(self, ceiling_s: float, floor_s: float, factor: float) -> None:
        self._ceiling = ceiling_s
        self._floor = floor_s
        self._factor = factor
        self._samples: deque[float] = deque(maxlen=_WINDOW)
        self._since = _EVERY  # computed at the first call with enough samples
        self._limit = ceiling_s
        self._waiting: dict[str, int] = {}  # decode -> its requests waiting for their first byte

    def observe(self, seconds: float) -> None:
        """A decode's first chunk came `seconds` after its request went out."""
        self._samples.append(seconds)
        self._since += 1

    def timeout(self) -> float:
        """The first-byte timeout now (a sort of at most 512 numbers every 16 first bytes)."""
        if self._factor <= 0 or len(self._samples) < MIN_SAMPLES:
            return self._ceiling
        if self._since >= _EVERY:
            ordered = sorted(self._samples)
            p99 = ordered[int(0.99 * (len(ordered) - 1))]
            self._limit = min(self._ceiling, max(self._floor, self._factor * p99))
            self._since = 0
        return self._limit

    def enter(self, decode: str) -> float:
        """A stream request goes to `decode`: its first-byte timeout (module doc). Pair with `leave`."""
        ahead = self._waiting.get(decode, 0)
        self._waiting[decode] = ahead + 1
        return min(self._ceiling, self.timeout() * (1 + ahead))

    def leave(self, decode: str) -> None:
        """The request sent to `decode` got its first byte, failed or was given up."""
        left = self._waiting.get(decode, 1) - 1
        if left > 0:
            self._waiting[decode] = left
        else:
            self._waiting.pop(decode, None)

"""A circuit breaker per instance: closed -> open -> half-open -> closed (pure; the clock is an argument).

Why per instance and passive: active health checks run every few seconds, while a dead engine fails
every request sent to it in between. After `failures` consecutive failures the breaker opens and the
instance gets no traffic for `open_s`; then one probe request is let through (half-open); `successes`
good probes close it, one failure opens it again. Outcomes are recorded per side (a prefill error never
counts against a decode), and a decode counts as a success only when its stream ended cleanly.

Every state change goes through `_move`, the one place that calls `on_transition` (logs, gauge).

`forgive` closes a breaker that opened because of a shared dependency rather than the instance (the
pool calls it when the ledger turns out to have been down: see `Pool.ledger_outage`).

A burst counts once: while closed, a failure counts only if its request was dispatched after the last
failure that counted (`on_dispatch` numbers the requests; `record_failure` gets the number back).
Why: requests in flight together and failing together (one client's fan-out of hundreds of prompts,
whose connect timeouts came from the router's own queueing) are one signal, not hundreds; before, one
such request opened the prefill's breaker and every other client got "unavailable". A dead engine still
opens it: each request sent after a counted failure fails too. A failure without a number counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = ["BreakerConfig", "BreakerState", "CircuitBreaker"]


class BreakerState(str, Enum):
    CLOSED = "closed"  # traffic flows; consecutive failures are counted
    OPEN = "open"  # no traffic until `open_s` has passed
    HALF_OPEN = "half_open"  # one probe at a time decides

    @property
    def gauge(self) -> int:
        return _GAUGE[self]


_GAUGE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


_CLOSED = BreakerState.CLOSED  # a module constant: an Enum member lookup costs on the hot path


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 5
    open_s: float = 10.0
    successes: int = 1


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig | None = None,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.config = config or BreakerConfig()
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probing = False
        self._sent = 0  # requests dispatched (`on_dispatch` numbers them)
        self._burst = 0  # requests numbered up to this were in flight when the last failure counted

    @property
    def closed(self) -> bool:
        """Closed lets every request through whatever the time; any other state depends on `now`."""
        return self._state is _CLOSED

    def state(self, now: float) -> BreakerState:
        """The state at `now` (an open breaker whose wait is over reads as half-open)."""
        if self._state is BreakerState.OPEN and now >= self._opened_at + self.config.open_s:
            self._move(BreakerState.HALF_OPEN)
        return self._state

    def can_pass(self, now: float) -> bool:
        if self._state is _CLOSED:  # the common case, asked for every candidate of every request
            return True
        st = self.state(now)
        if st is BreakerState.CLOSED:
            return True
        return st is BreakerState.HALF_OPEN and not self._probing

    def on_dispatch(self, now: float) -> int:
        """A request was sent: in half-open it is the probe, and no other passes until it ends. Returns
        its number, for `record_failure`."""
        self._sent += 1
        if self._state is not _CLOSED and self.state(now) is BreakerState.HALF_OPEN:
            self._probing = True
        return self._sent

    def record_success(self, now: float) -> None:
        if self._state is _CLOSED:
            self._failures = 0
            return
        st = self.state(now)
        if st is BreakerState.HALF_OPEN:
            self._probing = False
            self._successes += 1
            if self._successes >= self.config.successes:
                self._move(BreakerState.CLOSED)
        elif st is BreakerState.CLOSED:
            self._failures = 0

    def record_failure(self, now: float, dispatched: int | None = None) -> None:
        """A request failed; `dispatched` is its number from `on_dispatch` (see the module doc)."""
        st = self.state(now)
        if st is BreakerState.HALF_OPEN:
            self._probing = False
            self._open(now)
        elif st is BreakerState.CLOSED:
            if dispatched is not None and dispatched <= self._burst:
                return  # in flight with the last failure that counted: the same burst
            self._burst = self._sent
            self._failures += 1
            if self._failures >= self.config.failures:
                self._open(now)

    def forgive(self, since: float) -> bool:
        """Close the breaker if it opened at or after `since`; True if it did. Its failures then were
        not this instance's own (every instance failed the same way while the ledger was down)."""
        if self._state is BreakerState.CLOSED or self._opened_at < since:
            return False
        self._move(BreakerState.CLOSED)
        return True

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._move(BreakerState.OPEN)

    def _move(self, to: BreakerState) -> None:
        before = self._state
        if before is to:
            return
        self._state = to
        self._failures = 0
        self._successes = 0
        self._probing = False
        if self._on_transition is not None:
            self._on_transition(before, to)

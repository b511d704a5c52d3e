"""The claim-wait rule: what a claim does when the handoff cannot be claimed at once, decided in one place
for the router, the connector's control thread and `pdgate-sim`.

Why one rule: the three used to carry their own copies, and they disagreed on a handoff CLAIMED by
another decode (the connector failed, the simulator waited for the lease to lapse, the router took the
claim back), so tests and chaos runs on the simulator did not exercise what the connector does.

The rule, per outcome of a claim (`decide`), the first match winning:
    gone (410) / unknown (404)              fail: nothing is left to claim (the metaserver's code)
    409, the record terminal                fail: HANDOFF_TERMINAL
    409, past the deadline                  fail: KV_NOT_READY (not claimable within `wait_s`)
    409 PENDING                             long-poll the record (the prefill's READY is on its way)
    409 CLAIMED, `holder` given             take the claim back from `holder` once (renew it in its name
                                            with a lease of `release_lease_s`, so the sweeper requeues
                                            it), then claim again every `release_poll_s`
    409 CLAIMED, no `holder`                fail: claimed by another decode (the metaserver's code)
    409 READY / no state (a race)           claim again after a backoff
    unreachable (MetaUnavailable)           `retry_unavailable`: claim again after a backoff until the
                                            deadline; else fail (the metaserver's code)
    any other MetaError (401, 422, ...)     fail (the metaserver's code)
A long-poll that ends on a terminal record fails HANDOFF_TERMINAL (`after_poll`); else the claim is made
again. A long-poll's own failure goes through `decide` like a claim's.

Who passes a `holder`: only the router, for the decode of the request's earlier attempt, whose answer
it gave up on (docs/ARCHITECTURE.md, "Who claims": only the router hands a claim over). A decode
(connector, simulator) never takes another decode's claim: two decodes holding the same
`kv_transfer_params` is a client's duplicate, not a retry, and the router's retry already released the
claim it gave up on. So a decode fails at once instead of waiting out another decode's lease.

`decide` and `after_poll` are pure (no clock, no socket); `claim_handoff` drives them over a `Claims`
(a `MetaAPI` is one), with the clock and the sleep passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from pdgate.errors import Code, PDGateError
from pdgate.meta_client import MetaConflict, MetaError, MetaGone, MetaNotFound, MetaUnavailable
from pdgate.models import TERMINAL_STATES, Handoff, HandoffState

__all__ = ["Act", "ClaimRefused", "ClaimRule", "Claims", "Step", "after_poll", "claim_handoff", "decide"]


class Act(Enum):
    CLAIM = "claim"  # claim now
    POLL = "poll"  # long-poll the record for up to `Step.wait_s`, then decide again
    RETRY = "retry"  # sleep `Step.wait_s`, then claim
    TAKE_BACK = "take_back"  # release the holder's claim, then claim
    FAIL = "fail"  # give up: `Step.code`, `Step.message`


@dataclass(frozen=True, slots=True)
class Step:
    act: Act
    wait_s: float = 0.0
    code: Code | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class ClaimRule:
    """How long and how a caller waits; the table above is the same for every caller."""

    wait_s: float  # from the first claim, the longest the record may take to become claimable
    retry_unavailable: bool = True  # the router's false: an unreachable metaserver leaves it to the decode
    poll_cap_s: float = 10.0  # the longest single long-poll
    release_lease_s: float = 0.001  # the lease a claim taken back is shortened to
    release_poll_s: float = 0.02  # between claims while a claim taken back lapses
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 1.0

    def backoff(self, attempt: int) -> float:
        """Capped exponential delay before retry `attempt` (0-based); no jitter, so tests can name it."""
        return min(self.backoff_cap_s, self.backoff_base_s * float(1 << min(attempt, 16)))


class ClaimRefused(PDGateError):
    """The claim will not be made. `code`: HANDOFF_TERMINAL or HANDOFF_NOT_FOUND/NOT_FOUND (nothing left to
    claim), KV_NOT_READY (not claimable in time), the metaserver's 409 code (claimed by another decode),
    or the metaserver's own code for any other refusal (METASERVER_UNAVAILABLE, UNAUTHORIZED, ...)."""

    code = Code.INTERNAL


CLAIM = Step(Act.CLAIM)


def _fail(code: Code, message: str) -> Step:
    return Step(Act.FAIL, code=code, message=message)


def decide(exc: MetaError, *, left: float, attempt: int, holder: str | None, released: bool, rule: ClaimRule) -> Step:
    """The next step after a claim (or a long-poll) raised `exc`; `left`: seconds to the deadline."""
    state = exc.current_state
    if isinstance(exc, MetaGone):
        return _fail(exc.code, f"handoff is {state.value if state else 'terminal'}: {exc.detail}")
    if isinstance(exc, MetaNotFound):
        return _fail(exc.code, exc.detail)
    if isinstance(exc, MetaConflict):
        if state in TERMINAL_STATES:
            return _fail(Code.HANDOFF_TERMINAL, f"handoff is {state.value if state else 'terminal'}: {exc.detail}")
        if left <= 0:
            return _fail(Code.KV_NOT_READY, f"not claimable within {rule.wait_s:g}s: {exc.detail}")
        if state is HandoffState.PENDING:
            return Step(Act.POLL, wait_s=min(left, rule.poll_cap_s))
        if state is HandoffState.CLAIMED:
            if holder is None:
                return _fail(exc.code, f"claimed by another decode: {exc.detail}")
            return Step(Act.RETRY, wait_s=rule.release_poll_s) if released else Step(Act.TAKE_BACK)
        return Step(Act.RETRY, wait_s=min(left, rule.backoff(attempt)))
    if isinstance(exc, MetaUnavailable) and rule.retry_unavailable and left > 0:
        return Step(Act.RETRY, wait_s=min(left, rule.backoff(attempt)))
    return _fail(exc.code, exc.detail)


def after_poll(h: Handoff) -> Step:
    """The next step after a long-poll answered `h`: fail on a terminal record, else claim again."""
    if h.state in TERMINAL_STATES:
        return _fail(Code.HANDOFF_TERMINAL, f"handoff became {h.state.value}: {h.reason}")
    return CLAIM


class Claims(Protocol):
    """What the wait needs from the metaserver (`MetaAPI` has both; the connector batches its claims)."""

    async def claim(self, transfer_id: str, decode_instance_id: str, lease_s: float | None = None) -> Handoff: ...
    async def get_handoff(self, transfer_id: str, wait: float | None = None) -> Handoff: ...


async def claim_handoff(
    meta: Claims,
    transfer_id: str,
    decode_id: str,
    *,
    rule: ClaimRule,
    lease_s: float | None = None,
    holder: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Handoff:
    """Claim `transfer_id` for `decode_id`, waiting as the rule says; raises `ClaimRefused` when it will not.

    `holder`: a decode whose claim the caller may take back (the router's earlier attempt), else None.
    """
    deadline = clock() + rule.wait_s
    attempt = 0
    released = False
    step = CLAIM
    while True:
        try:
            if step.act is Act.CLAIM:
                return await meta.claim(transfer_id, decode_id, lease_s)
            if step.act is Act.POLL:
                step = after_poll(await meta.get_handoff(transfer_id, wait=step.wait_s))
                continue
            if step.act is Act.TAKE_BACK and holder is not None:
                released = True
                with contextlib.suppress(MetaError):  # no longer the holder's: the next claim says what it is
                    await meta.claim(transfer_id, holder, rule.release_lease_s)
                step = Step(Act.RETRY, wait_s=rule.release_poll_s)
            if step.act is Act.RETRY:
                await sleep(step.wait_s)
                attempt += 1
                step = CLAIM
                continue
            raise ClaimRefused(step.message, code=step.code or Code.INTERNAL)
        except MetaError as exc:
            step = decide(exc, left=deadline - clock(), attempt=attempt, holder=holder, released=released, rule=rule)

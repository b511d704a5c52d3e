"""`pdgate.claim_wait`'s table, row by row, without sockets: what a claim does next after each outcome.

The rows that matter most: a decode (no `holder`) fails at once on a handoff another decode holds, the
router (a `holder`) takes that decode's claim back exactly once; PENDING long-polls; an unreachable
metaserver is retried by a decode and left to the decode by the router."""

from __future__ import annotations

import pytest

from pdgate.claim_wait import Act, ClaimRule, Step, after_poll, decide
from pdgate.errors import Code
from pdgate.meta_client import (
    MetaBadRequest,
    MetaConflict,
    MetaError,
    MetaGone,
    MetaNotFound,
    MetaUnauthorized,
    MetaUnavailable,
)
from pdgate.models import Handoff, HandoffState

S = HandoffState
DECODE = ClaimRule(30.0)
ROUTER = ClaimRule(5.0, retry_unavailable=False, poll_cap_s=5.0, release_poll_s=0.02)


def conflict(state: HandoffState | None) -> MetaConflict:
    return MetaConflict("refused", status=409, current_state=state)


def step(
    exc: MetaError,
    *,
    left: float = 10.0,
    attempt: int = 0,
    holder: str | None = None,
    released: bool = False,
    rule: ClaimRule = DECODE,
) -> Step:
    return decide(exc, left=left, attempt=attempt, holder=holder, released=released, rule=rule)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (MetaGone("gone", current_state=S.ABORTED), Code.HANDOFF_TERMINAL),
        (MetaNotFound("unknown", code=Code.HANDOFF_NOT_FOUND), Code.HANDOFF_NOT_FOUND),
        (conflict(S.DONE), Code.HANDOFF_TERMINAL),
        (MetaUnauthorized("wrong token"), Code.UNAUTHORIZED),
        (MetaBadRequest("refused body", status=422), Code.INVALID_REQUEST),
    ],
)
@pytest.mark.parametrize("rule", [DECODE, ROUTER])
def test_nothing_to_claim_or_a_refusal_fails_at_once_for_every_caller(
    exc: MetaError, code: Code, rule: ClaimRule
) -> None:
    s = step(exc, rule=rule, holder="d-old" if rule is ROUTER else None)
    assert s.act is Act.FAIL and s.code is code


def test_pending_long_polls_capped_by_the_rule_and_by_the_deadline() -> None:
    assert step(conflict(S.PENDING), left=30.0) == Step(Act.POLL, wait_s=DECODE.poll_cap_s)
    assert step(conflict(S.PENDING), left=0.5) == Step(Act.POLL, wait_s=0.5)


def test_past_the_deadline_a_conflict_is_kv_not_ready() -> None:
    for state in (S.PENDING, S.CLAIMED, S.READY, None):
        s = step(conflict(state), left=0.0, holder="d-old")
        assert s.act is Act.FAIL and s.code is Code.KV_NOT_READY


def test_a_decode_fails_at_once_on_a_handoff_another_decode_holds() -> None:
    s = step(conflict(S.CLAIMED), left=30.0)
    assert s.act is Act.FAIL and s.code is Code.ILLEGAL_TRANSITION
    assert "claimed by another decode" in s.message


def test_the_router_takes_back_its_earlier_decodes_claim_once_then_polls() -> None:
    assert step(conflict(S.CLAIMED), holder="d-old", rule=ROUTER).act is Act.TAKE_BACK
    again = step(conflict(S.CLAIMED), holder="d-old", released=True, rule=ROUTER)
    assert again == Step(Act.RETRY, wait_s=ROUTER.release_poll_s)


def test_a_racing_ready_or_stateless_conflict_is_retried_after_a_growing_backoff() -> None:
    waits = [step(conflict(S.READY), attempt=a).wait_s for a in range(8)]
    assert all(step(conflict(S.READY), attempt=a).act is Act.RETRY for a in range(8))
    assert waits == sorted(waits) and waits[0] < waits[-1] == DECODE.backoff_cap_s
    assert step(conflict(None)).act is Act.RETRY
    assert step(conflict(S.READY), left=0.01, attempt=9).wait_s == 0.01  # never sleeps past the deadline


def test_unreachable_is_retried_by_a_decode_until_the_deadline_and_left_to_the_decode_by_the_router() -> None:
    down = MetaUnavailable("unreachable")
    assert step(down).act is Act.RETRY
    late = step(down, left=0.0)
    assert late.act is Act.FAIL and late.code is Code.METASERVER_UNAVAILABLE
    routed = step(down, rule=ROUTER, holder="d-old")
    assert routed.act is Act.FAIL and routed.code is Code.METASERVER_UNAVAILABLE


def _record(state: HandoffState) -> Handoff:
    return Handoff(
        transfer_id="t-1",
        kv_key=1,
        lease_s=5.0,
        state=state,
        prefill_instance_id="p-1",
        created_at=0.0,
        updated_at=0.0,
        reason="aborted by test" if state is S.ABORTED else None,
    )


def test_a_long_poll_ending_on_a_terminal_record_fails_else_claims_again() -> None:
    ended = after_poll(_record(S.ABORTED))
    assert ended.act is Act.FAIL and ended.code is Code.HANDOFF_TERMINAL and "ABORTED" in ended.message
    for state in (S.READY, S.PENDING, S.CLAIMED):
        assert after_poll(_record(state)).act is Act.CLAIM

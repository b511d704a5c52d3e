"""Service errors are the client's typed errors, and render as RFC 7807 problems."""

from __future__ import annotations

import orjson
from pdgate.metaserver import client, errors
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.models import HandoffState, Problem


def test_illegal_transition_is_409_while_live_and_410_when_terminal() -> None:
    live = errors.from_illegal(IllegalTransition(HandoffState.CLAIMED, HandoffState.CLAIMED), "t1")
    assert isinstance(live, client.MetaConflict) and live.status == 409 and live.current_state is HandoffState.CLAIMED
    gone = errors.from_illegal(IllegalTransition(HandoffState.DONE, HandoffState.ABORTED), "t1")
    assert isinstance(gone, client.MetaGone) and gone.status == 410 and gone.code == "handoff_terminal"
    assert "t1" in gone.detail


def test_problem_response_shape() -> None:
    resp = errors.problem_response(errors.StoreUnavailable("redis down"), instance="/v1/handoffs")
    assert resp.status_code == 503 and resp.media_type == "application/problem+json"
    body = orjson.loads(resp.body)
    problem = Problem.model_validate(body)
    assert (problem.status, problem.code, problem.detail) == (503, "store_unavailable", "redis down")
    assert "current_state" not in body


def test_every_error_is_a_typed_client_error() -> None:
    pairs = [
        (errors.InvalidInput, client.MetaBadRequest, 422),
        (errors.MalformedBody, client.MetaBadRequest, 400),
        (errors.BodyTooLarge, client.MetaBadRequest, 413),
        (errors.Unauthorized, client.MetaUnauthorized, 401),
        (errors.InstanceNotFound, client.MetaNotFound, 404),
        (errors.HandoffNotFound, client.MetaNotFound, 404),
        (errors.HandoffExists, client.MetaConflict, 409),
        (errors.HandoffTerminal, client.MetaGone, 410),
        (errors.StoreUnavailable, client.MetaUnavailable, 503),
    ]
    for cls, base, status in pairs:
        assert issubclass(cls, base) and cls("x").status == status
    assert errors.StoreUnavailable("x").retryable

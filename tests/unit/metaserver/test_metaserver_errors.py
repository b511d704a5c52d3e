"""Service errors are the client's typed errors, and render as RFC 7807 problems."""

from __future__ import annotations

import orjson
import pytest
from pdgate.metaserver import errors
from pdgate.metaserver.ledger import IllegalTransition
from pdgate.metaserver.registry import RegistrationInvalid

from pdgate import meta_client as client
from pdgate.errors import CODES, PDGateError
from pdgate.models import HandoffState, Problem


def test_illegal_transition_is_409_while_live_and_410_when_terminal() -> None:
    live = errors.from_core(IllegalTransition(HandoffState.CLAIMED, HandoffState.CLAIMED), "t1")
    assert isinstance(live, client.MetaConflict) and live.status == 409 and live.current_state is HandoffState.CLAIMED
    gone = errors.from_core(IllegalTransition(HandoffState.DONE, HandoffState.ABORTED), "t1")
    assert isinstance(gone, client.MetaGone) and gone.status == 410 and gone.code == "handoff_terminal"
    assert "t1" in gone.detail


def test_core_errors_maps_each_core_refusal_once() -> None:
    with pytest.raises(errors.IllegalState) as err, errors.core_errors("t1"):
        raise IllegalTransition(HandoffState.READY, HandoffState.DONE)
    assert err.value.detail == "handoff t1: cannot move a READY handoff to DONE (it is READY)"
    with pytest.raises(errors.InvalidInput) as bad, errors.core_errors("body"):
        raise RegistrationInvalid("transport_addresses[1].tp_rank", "appears twice")
    assert bad.value.detail == "body.transport_addresses[1].tp_rank: appears twice" and bad.value.status == 422


def test_every_error_is_a_pdgate_error_with_a_code_of_the_vocabulary() -> None:
    classes = [errors.InternalError, errors.StoreFailure, client.MetaError, IllegalTransition]
    for cls in classes:
        assert issubclass(cls, PDGateError) and cls.code in CODES
    assert errors.StoreFailure("x").status == 500 and errors.InternalError("x").code == "internal_error"


def test_an_answer_becomes_the_family_of_its_status_with_the_body_code() -> None:
    body = b'{"code": "handoff_exists", "detail": "taken", "current_state": "PENDING"}'
    err = client.error_from_answer(409, body, "POST", "/v1/handoffs")
    assert type(err) is client.MetaConflict and err.code == "handoff_exists" and err.status == 409
    assert err.current_state is HandoffState.PENDING and err.detail.endswith(": taken")
    newer = client.error_from_answer(503, b'{"code": "a_code_of_a_newer_peer"}', "GET", "/health")
    assert type(newer) is client.MetaUnavailable and newer.retryable and newer.status == 503
    odd = client.error_from_answer(502, b"not json", "GET", "/health")
    assert odd.status == 502 and odd.code == "pd_metaserver_unavailable"


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
        (errors.AdminTokenRequired, client.MetaUnauthorized, 401),
        (errors.InstanceNotFound, client.MetaNotFound, 404),
        (errors.HandoffNotFound, client.MetaNotFound, 404),
        (errors.HandoffExists, client.MetaConflict, 409),
        (errors.HandoffTerminal, client.MetaGone, 410),
        (errors.StoreUnavailable, client.MetaUnavailable, 503),
    ]
    for cls, base, status in pairs:
        assert issubclass(cls, base) and cls("x").status == status
    assert errors.StoreUnavailable("x").retryable


def test_core_errors_lets_other_exceptions_and_clean_exits_through() -> None:
    with errors.core_errors("t1"):
        pass
    with pytest.raises(KeyError), errors.core_errors("t1"):
        raise KeyError("not a core refusal")
    with pytest.raises(errors.IllegalState) as err, errors.core_errors("t1"):
        raise IllegalTransition(HandoffState.READY, HandoffState.DONE)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_every_status_a_code_carries_has_its_own_title() -> None:
    """429 (too many long-polls) was titled "Error": titles come from http.HTTPStatus, not a short table."""
    from http import HTTPStatus

    from pdgate.metaserver.guards import TooManyLongPolls

    body = orjson.loads(errors.problem_body(TooManyLongPolls("busy")))
    assert (body["status"], body["title"]) == (429, "Too Many Requests")
    for info in CODES.values():
        assert errors.title(info.status) == HTTPStatus(info.status).phrase != "Error"
    assert errors.title(599) == "Error"

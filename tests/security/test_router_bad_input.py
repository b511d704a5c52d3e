"""Bad input never gives a 5xx, and a client cannot take an engine out of rotation (issue 9).

Before: JSON nested 300 deep got a 500 with a traceback per request; five requests with
`"max_tokens": "7"` made the simulator's decode answer 500 and opened its breaker for everyone; a
trailing slash got an empty 307; a 405 had no `Allow`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until


@pytest.fixture(scope="module")
def pd() -> Iterator[Deployment]:
    with Deployment(breaker_failures=2) as d:
        d.add_many([("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
        yield d


def _nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


def test_json_nested_deeper_than_the_router_can_re_encode_is_a_400(pd: Deployment) -> None:
    for endpoint, body in (
        ("/v1/completions", {"model": "sim-model", "prompt": "x", "logit_bias": _nested(300)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": _nested(300)}),
    ):
        got = httpx.post(pd.url + endpoint, json=body, timeout=10)
        assert got.status_code == 400, got.text
        assert got.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "7"),
        ("max_tokens", -1),
        ("max_tokens", True),
        ("n", 0),
        ("n", "2"),
        ("stream", "yes"),
        ("prompt", 5),
        ("prompt", [1, "a"]),
        ("prompt", []),
        ("model", 3),
    ],
)
def test_fields_the_router_relies_on_are_checked_before_dispatch(pd: Deployment, field: str, value: Any) -> None:
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        pd.openai().completions.create(**body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field  # type: ignore[index]


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 5}], ["not an object"]],
)
def test_chat_messages_are_checked_before_dispatch(pd: Deployment, messages: Any) -> None:
    got = httpx.post(pd.url + "/v1/chat/completions", json={"model": "sim-model", "messages": messages}, timeout=5)
    assert got.status_code == 400 and got.json()["error"]["param"] == "messages", got.text


def test_bad_fields_cannot_open_a_decodes_breaker(pd: Deployment) -> None:
    before = {s.id: s.count("requests") for s in pd.sims}
    for _ in range(5):
        got = httpx.post(
            pd.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": "7"}, timeout=5
        )
        assert got.status_code == 400
    assert {s.id: s.count("requests") for s in pd.sims} == before  # no engine saw any of them
    assert all(i["available"] and i["breaker"] == "closed" for i in pd.health()["instances"])
    assert pd.openai().completions.create(model="sim-model", prompt="still served", max_tokens=2).choices


def test_a_trailing_slash_is_a_json_404_not_a_redirect(pd: Deployment) -> None:
    for path in ("/v1/completions/", "/v1/models/", "/health/", "/nowhere"):
        got = httpx.post(pd.url + path, json={}, timeout=5) if "compl" in path else httpx.get(pd.url + path)
        assert got.status_code == 404, (path, got.status_code)
        assert got.json()["error"]["code"] == "not_found"
    got = httpx.get(pd.url + "/v1/instances/", timeout=5)  # the metaserver's routes answer RFC 7807
    assert got.status_code == 404 and got.headers["content-type"].startswith("application/problem+json")


def test_a_405_names_the_allowed_methods(pd: Deployment) -> None:
    for method, path, allowed in (
        ("GET", "/v1/completions", {"POST"}),
        ("DELETE", "/v1/chat/completions", {"POST"}),
        ("POST", "/health", {"GET"}),
        ("PUT", "/v1/models", {"GET"}),
        ("PUT", "/v1/instances", {"GET", "POST"}),
    ):
        got = httpx.request(method, pd.url + path, timeout=5)
        assert got.status_code == 405, (method, path, got.status_code)
        assert {m.strip() for m in got.headers["allow"].split(",")} == allowed, (path, got.headers["allow"])

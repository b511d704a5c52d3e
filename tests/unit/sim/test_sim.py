"""pdgate.sim: scripted (never random) faults, deterministic tokens, prompt accounting, and the 400s a
client's bad field gets (over a real socket), as from vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pdgate.sim.app import SimApp
from pdgate.sim.settings import Script, SimSettings
from pdgate.sim.wire import prompt_of, tokens_for

from tests.support.servers import UvicornThread


def app(**kw: object) -> SimApp:
    return SimApp(SimSettings(**kw))  # type: ignore[arg-type]


def failures(sim: SimApp, n: int) -> list[bool]:
    return [sim._scripted_failure() for _ in range(n)]


def test_fail_first_then_fail_rate_evenly_spaced() -> None:
    sim = app(fail_first=2)
    assert failures(sim, 4) == [True, True, False, False]
    sim.script.update({"fail_rate": 0.25})
    pattern = failures(sim, 12)
    assert sum(pattern) == 3 and pattern == [i % 4 == 3 for i in range(12)]  # every 4th request served


def test_script_refuses_unknown_fields() -> None:
    s = Script()
    with pytest.raises(ValueError, match="unknown script fields: nope"):
        s.update({"nope": 1})


def test_tokens_are_a_function_of_the_prompt() -> None:
    assert tokens_for("hello", 8) == tokens_for("hello", 8)
    assert tokens_for("hello", 8) != tokens_for("world", 8)
    assert tokens_for("hello", 3) == tokens_for("hello", 8)[:3]
    assert all(t.startswith(" ") for t in tokens_for("x", 5))


def test_prompt_accounting() -> None:
    assert prompt_of({"prompt": "a b c"}, chat=False) == ("a b c", 3)
    assert prompt_of({"prompt": [1, 2, 3, 4]}, chat=False)[1] == 4
    text, n = prompt_of({"messages": [{"role": "user", "content": "hi there"}]}, chat=True)
    assert text == "hi there" and n == 2 + 4


def test_ids_per_dp_rank_and_from_the_url() -> None:
    assert app(port=9100).record_id(0) == "127.0.0.1-9100"
    multi = app(instance_id="eng", dp_size=2)
    assert [multi.record_id(r) for r in range(2)] == ["eng.dp0", "eng.dp1"]
    reg = multi.registration(1)
    assert reg.dp_rank == 1 and reg.dp_size == 2 and reg.engine_id == "eng.dp1" and reg.transport.value == "sim"


def test_admin_token_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_SIM_ADMIN_TOKEN", "s3cret")
    assert SimSettings().admin_token == "s3cret"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with UvicornThread(SimApp(SimSettings(role="both"))) as server:
        yield server.url


DECODE = {"do_remote_prefill": True, "remote_engine_id": "p0", "transfer_id": "t-1"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": "7"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
        ({"n": "2"}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"model": 3}, "model"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"stream_options": [1]}, "stream_options"),
        ({"kv_transfer_params": "x"}, "kv_transfer_params"),
        ({"kv_transfer_params": {**DECODE, "kv_key": "k"}}, "kv_key"),
    ],
)
def test_a_bad_field_is_a_400_not_an_engine_failure(sim: str, change: dict[str, Any], field: str) -> None:
    """A 5xx here would count against the engine's breaker in a router: five requests with
    `"max_tokens": "7"` took a decode out of rotation for every user."""
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2, "kv_transfer_params": DECODE, **change}
    for _ in range(5):
        r = httpx.post(sim + "/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and field in err["message"]
    ok = httpx.post(sim + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": DECODE})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_chat_messages_are_checked(sim: str) -> None:
    for messages in ("hi", [], [{"content": "no role"}], [{"role": "user", "content": 5}]):
        r = httpx.post(sim + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, (messages, r.text)
    r = httpx.post(sim + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"

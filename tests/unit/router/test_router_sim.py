"""sim.py's pure parts: scripted (never random) faults, deterministic tokens, prompt accounting."""

from __future__ import annotations

import pytest
from pdgate.router.sim import Script, SimApp, SimSettings, _prompt, _tokens


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
    assert _tokens("hello", 8) == _tokens("hello", 8)
    assert _tokens("hello", 8) != _tokens("world", 8)
    assert _tokens("hello", 3) == _tokens("hello", 8)[:3]
    assert all(t.startswith(" ") for t in _tokens("x", 5))


def test_prompt_accounting() -> None:
    assert _prompt({"prompt": "a b c"}, chat=False) == ("a b c", 3)
    assert _prompt({"prompt": [1, 2, 3, 4]}, chat=False)[1] == 4
    text, n = _prompt({"messages": [{"role": "user", "content": "hi there"}]}, chat=True)
    assert text == "hi there" and n == 2 + 4


def test_ids_per_dp_rank_and_from_the_url() -> None:
    assert app(port=9100).record_id(0) == "127.0.0.1-9100"
    multi = app(instance_id="eng", dp_size=2)
    assert [multi.record_id(r) for r in range(2)] == ["eng.dp0", "eng.dp1"]
    reg = multi.registration(1)
    assert reg.dp_rank == 1 and reg.dp_size == 2 and reg.engine_id == "eng.dp1" and reg.transport.value == "sim"

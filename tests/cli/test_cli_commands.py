"""`pdgate instances / handoffs / drain / undrain / top` against a real router and pdgate-sim engines."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import TOKEN, pdgate
from tests.integration.router.conftest import HTTP, Deployment, transfer_ids
from tests.support.ports import wait_until


def _conn(stack: Deployment) -> list[str]:
    return ["--router", stack.url, "--token", TOKEN]


def test_instances_lists_the_registry_with_the_routers_view(
    stack: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = pdgate(capsys, "instances", *_conn(stack), "--json")
    assert code == 0
    rows = {r["id"]: r for r in json.loads(out)}
    assert {s.id for s in stack.sims} == set(rows)
    for sim in stack.sims:
        assert rows[sim.id]["role"] == sim.role
        assert rows[sim.id]["url"] == sim.url
        assert rows[sim.id]["breaker"] == "closed"
        assert rows[sim.id]["available"] is True
    code, table, _ = pdgate(capsys, "instances", *_conn(stack), "--role", "decode")
    lines = table.strip().splitlines()
    assert lines[0].split()[:4] == ["ID", "ROLE", "MODEL", "STATE"]
    assert len(lines) == 2 and stack.by_role("decode")[0].id in lines[1]


def test_drain_then_undrain_moves_the_instance_and_the_router_sees_it(
    stack: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = stack.by_role("decode")[0]
    code, out, _ = pdgate(capsys, "drain", decode.id, *_conn(stack))
    assert code == 0 and "draining" in out
    stack.wait_available(decode.id, available=False)
    code, out, _ = pdgate(capsys, "instances", *_conn(stack), "--state", "draining", "--json")
    assert [r["id"] for r in json.loads(out)] == [decode.id]
    code, out, _ = pdgate(capsys, "undrain", decode.id, *_conn(stack), "--json")
    assert code == 0 and json.loads(out)["state"] == "ready"
    stack.wait_available(decode.id)


def test_undrain_of_an_unknown_instance_says_so(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = pdgate(capsys, "undrain", "nobody-here", *_conn(stack))
    assert code == 1
    assert "404" in err and "nobody-here" in err


def test_a_wrong_token_names_the_setting(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = pdgate(capsys, "instances", "--router", stack.url, "--token", "wrong")
    assert code == 1
    assert "refused the token" in err and "--token" in err


def test_handoffs_one_by_id_and_the_live_counts(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    answer = stack.openai().completions.create(model="sim-model", prompt="hello", max_tokens=3)
    assert answer.choices[0].text
    tid = transfer_ids(stack.by_role("prefill")[0], "prefill")[-1]
    code, out, _ = pdgate(capsys, "handoffs", tid, *_conn(stack), "--json")
    assert code == 0
    h = json.loads(out)
    assert h["transfer_id"] == tid and h["state"] == "DONE"
    code, out, _ = pdgate(capsys, "handoffs", "--counts", *_conn(stack), "--json")
    assert code == 0
    assert set(json.loads(out)) == {"PENDING", "READY", "CLAIMED"}  # the live states, each counted
    code, out, _ = pdgate(capsys, "handoffs", "--counts", *_conn(stack), "--state", "ready")
    assert out.split()[:2] == ["STATE", "COUNT"] and "READY" in out and "PENDING" not in out


def test_top_once_shows_load_breakers_and_the_routers_phase_counts(
    stack: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    stack.openai().completions.create(model="sim-model", prompt="top", max_tokens=2)
    code, out, _ = pdgate(capsys, "top", "--once", *_conn(stack), "--json")
    assert code == 0
    data = json.loads(out)
    assert {r["id"] for r in data["instances"]} == {s.id for s in stack.sims}
    phases = {p["phase"]: p for p in data["phases"]}
    metrics = HTTP.get(stack.url + "/metrics").text
    e2e_count = next(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("pdgate_router_e2e_seconds_count")
    )
    assert phases["e2e"]["count"] == int(e2e_count) >= 1
    assert phases["e2e"]["p50_ms"] is not None
    code, table, _ = pdgate(capsys, "top", "--once", *_conn(stack))
    assert "BREAKER" in table and "P99_MS" in table


def test_drain_waits_for_the_router_to_drop_the_instance(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """The drain the command asks for is what the router acts on: no new request reaches a drained prefill."""
    prefill = stack.by_role("prefill")[0]
    assert pdgate(capsys, "drain", prefill.id, *_conn(stack))[0] == 0
    try:
        stack.wait_available(prefill.id, available=False)
        before = prefill.count("requests")
        decode = stack.by_role("decode")[0]
        plain = decode.count("plain")
        # No ready prefill: the router serves the request on the decode alone.
        assert stack.openai().completions.create(model="sim-model", prompt="x", max_tokens=1).choices[0].text
        assert prefill.count("requests") == before
        assert decode.count("plain") == plain + 1
    finally:
        assert pdgate(capsys, "undrain", prefill.id, *_conn(stack))[0] == 0
        wait_until(lambda: stack.health()["status"] == "ok", what="router serving again")


def test_top_shows_what_clients_wait_for(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    decode = stack.by_role("decode")[0]
    decode.script(token_delay=0.005)  # tokens apart in time: a stream with time between its tokens
    try:
        for _ in stack.openai().completions.create(model="sim-model", prompt="s", max_tokens=4, stream=True):
            pass
    finally:
        decode.script(token_delay=0.0)
    _, out, _ = pdgate(capsys, "top", "--once", *_conn(stack), "--json")
    phases = {p["phase"]: p for p in json.loads(out)["phases"]}
    assert phases["ttft"]["count"] >= 1 and phases["tpot"]["count"] >= 1
    assert phases["ttft"]["p50_ms"] is not None

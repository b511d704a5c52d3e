"""The PD flow through a real router to 2 prefill + 2 decode simulators, with the official openai client.

The simulators register with the router's embedded metaserver, record READY/DONE in its ledger, and each
decode checks that the kv_transfer_params it got come from the prefill that holds the handoff.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from pdgate.models import HandoffState
from tests.integration.router.conftest import Deployment, transfer_ids

TOKEN = "admin-secret"


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    with Deployment(prefill_policy="round_robin", decode_policy="round_robin", admin_token=TOKEN) as d:
        d.add_many([("prefill", ()), ("prefill", ()), ("decode", ()), ("decode", ())])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> None:
    dep.reset_sims()


def assert_pd_consistent(dep: Deployment, n: int) -> None:
    """Every request was prefilled once and decoded once, each decode with its own prefill's KV."""
    prefilled = [t for s in dep.by_role("prefill") for t in transfer_ids(s, "prefill")]
    decoded = [t for s in dep.by_role("decode") for t in transfer_ids(s, "decode")]
    assert len(prefilled) == n and sorted(prefilled) == sorted(decoded)
    for s in dep.sims:
        assert s.count("mismatches") == 0 and s.count("ledger_errors") == 0
    assert sum(s.count("claimed") for s in dep.by_role("decode")) == n


def test_completions(dep: Deployment) -> None:
    c = dep.openai()
    a = c.completions.create(model="sim-model", prompt="the quick brown fox", max_tokens=7)
    b = c.completions.create(model="sim-model", prompt="the quick brown fox", max_tokens=7)
    assert a.choices[0].finish_reason == "length" and a.choices[0].text == b.choices[0].text
    assert len(a.choices[0].text.split()) == 7
    assert a.usage is not None and a.usage.completion_tokens == 7 and a.usage.prompt_tokens == 4
    assert_pd_consistent(dep, 2)


def test_completions_stream(dep: Deployment) -> None:
    c = dep.openai()
    stream = c.completions.create(
        model="sim-model", prompt="stream me", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert len(text.split()) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert_pd_consistent(dep, 1)


def test_chat_and_chat_stream(dep: Deployment) -> None:
    c = dep.openai()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant" and len(whole.choices[0].message.content.split()) == 4
    parts = c.chat.completions.create(model="sim-model", messages=msgs, max_completion_tokens=4, stream=True)  # type: ignore[arg-type]
    text = "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices)
    assert text == whole.choices[0].message.content
    assert_pd_consistent(dep, 2)


def test_round_robin_uses_every_instance(dep: Deployment) -> None:
    c = dep.openai()
    for i in range(4):
        c.completions.create(model="sim-model", prompt=f"p{i}", max_tokens=2)
    for s in dep.sims:
        assert s.count("requests") == 2, s.id
    assert_pd_consistent(dep, 4)


def test_fields_pass_through_and_the_request_id_reaches_both(dep: Deployment) -> None:
    c = dep.openai()
    c.completions.create(
        model="sim-model",
        prompt="fields",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 2, "top_k": 5, "ignore_eos": True, "repetition_penalty": 1.1},
        extra_headers={"X-Request-Id": "client-req-1"},
    ).close()
    [p_entry] = [e for s in dep.by_role("prefill") for e in s.stats(log=True)["log"]]
    [d_entry] = [e for s in dep.by_role("decode") for e in s.stats(log=True)["log"]]
    assert p_entry["request_id"] == d_entry["request_id"] == "client-req-1"
    p, d = p_entry["body"], d_entry["body"]
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p and "min_tokens" not in p
    assert d["max_tokens"] == 6 and d["stream"] is True and d["stream_options"] == {"include_usage": True}
    for body in (p, d):
        assert body["top_k"] == 5 and body["ignore_eos"] is True and body["repetition_penalty"] == 1.1
    assert d["kv_transfer_params"]["transfer_id"] == p["kv_transfer_params"]["transfer_id"]
    assert d["kv_transfer_params"]["do_remote_prefill"] is True
    assert p["kv_transfer_params"]["metaserver"] == dep.url


def test_handoffs_end_done_in_the_embedded_ledger(dep: Deployment) -> None:
    dep.openai().completions.create(model="sim-model", prompt="ledger", max_tokens=2)
    [tid] = [t for s in dep.by_role("decode") for t in transfer_ids(s, "decode")]
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{dep.url}/v1/handoffs/{tid}").status_code == 401  # reads need the admin token too
    h = httpx.get(f"{dep.url}/v1/handoffs/{tid}", headers=auth).json()
    assert h["state"] == HandoffState.DONE.value and h["prefill_instance_id"] in {s.id for s in dep.by_role("prefill")}
    assert h["decode_instance_id"] in {s.id for s in dep.by_role("decode")}


def test_embedded_metaserver_routes_share_the_port(dep: Deployment) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    listed = httpx.get(dep.url + "/v1/instances", headers=auth).json()["instances"]
    assert {i["id"] for i in listed} == {s.id for s in dep.sims}
    body = {"id": "rogue", "role": "prefill", "url": "http://127.0.0.1:1", "model": "sim-model"}
    assert httpx.post(dep.url + "/v1/instances", json=body).status_code == 401
    assert httpx.post(dep.url + "/v1/handoffs", json={"prefill_instance_id": "x"}).status_code == 401
    assert httpx.post(dep.url + "/v1/handoffs", json={"prefill_instance_id": "x"}, headers=auth).status_code == 201


def test_models_health_metrics(dep: Deployment) -> None:
    models = dep.openai().models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    health = dep.health()
    assert health["status"] == "ok" and health["models"] == ["sim-model"] and len(health["instances"]) == 4
    dep.openai().completions.create(model="sim-model", prompt="m", max_tokens=1)
    text = httpx.get(dep.url + "/metrics").text
    for name in (
        "pdgate_router_requests_total",
        "pdgate_router_prefill_seconds_bucket",
        "pdgate_router_decode_ttft_seconds_bucket",
        "pdgate_router_overhead_seconds_bucket",
        "pdgate_router_handoff_seconds_bucket",
        "pdgate_router_e2e_seconds_bucket",
        "pdgate_router_instance_inflight",
        "pdgate_metaserver_",
    ):
        assert name in text, name
    # the embedded metaserver's store-wide gauge is read at scrape time, one series per live state
    for state in ("PENDING", "READY", "CLAIMED"):
        assert f'pdgate_metaserver_handoffs{{state="{state}"}}' in text, state


def test_client_errors(dep: Deployment) -> None:
    c = dep.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="sim-model", prompt="one", max_tokens=2, extra_body={"use_beam_search": True})
    assert bad.value.code == "pd_unsupported_parameter" and bad.value.param == "use_beam_search"
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:  # past the engines' max_model_len: no engine work
        c.completions.create(model="sim-model", prompt="x", max_tokens=10**6)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as refused:  # the decode's own 400, relayed as is, not retried
        c.completions.create(model="sim-model", prompt="x", max_tokens=32768)
    assert "maximum context length" in str(refused.value)
    assert sum(s.count("decode") for s in dep.by_role("decode")) == 1


def test_prefix_affinity_keeps_a_prefix_on_one_prefill() -> None:
    with Deployment(prefill_policy="prefix_affinity", prefix_chars=32) as d:
        p = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
        d.wait_available(*(s.id for s in p))
        c = d.openai()
        shared = "You are a careful assistant. " * 4
        for i in range(6):
            c.completions.create(model="sim-model", prompt=shared + f"question {i}", max_tokens=1)
        counts = sorted(s.count("prefill") for s in p[:2])
        assert counts == [0, 6]
        for i in range(12):
            c.completions.create(model="sim-model", prompt=f"{i} different prompt " * 3, max_tokens=1)
        assert min(s.count("prefill") for s in p[:2]) > 0

"""Every failure path of the PD flow, over real sockets: retries, typed errors, aborts, admission.

One deployment (router with embedded metaserver + 2 prefill + 2 decode sims) serves the module; each test
scripts the faults it needs and `clean` resets them. Routers for admission and API keys are extra,
static-mode routers in front of the same sims.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest
from pdgate.metaserver.settings import MetaSettings

from tests.integration.router.conftest import HTTP, Deployment, transfer_ids
from tests.support.ports import wait_until

TOKEN = "failures-admin-token"


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    # With an admin token, as deployed: the router seals its claims with it and the sims check the seal.
    meta = MetaSettings(ready_lease_s=0.5, sweep_interval_s=0.05, admin_token=TOKEN)
    with Deployment(
        meta_settings=meta,
        admin_token=TOKEN,
        prefill_policy="round_robin",
        decode_policy="round_robin",
        prefill_timeout_s=2.5,
        decode_timeout_s=5.0,
        breaker_failures=1000,
        whole_on_failure=False,  # the PD path's own typed errors (router/whole.py serves them whole)
        max_resumes=0,
    ) as d:
        d.add_many([("prefill", ()), ("prefill", ()), ("decode", ()), ("decode", ())])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> None:
    dep.reset_sims()


def handoff_state(dep: Deployment, tid: str) -> str:
    return str(HTTP.get(f"{dep.url}/v1/handoffs/{tid}", headers={"Authorization": f"Bearer {TOKEN}"}).json()["state"])


def send_raw(url: str, body: dict) -> socket.socket:
    """A request on a raw socket, so the test decides when the client goes away."""
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port))
    data = orjson.dumps(body)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
    s.sendall(head + b"content-length: %d\r\n\r\n" % len(data) + data)
    return s


def complete(dep: Deployment, **kw: object) -> openai.types.Completion:
    return dep.openai().completions.create(model="sim-model", prompt=kw.pop("prompt", "hi"), max_tokens=3, **kw)  # type: ignore[call-overload, no-any-return]


def test_prefill_failure_is_retried_on_another_prefill_with_a_new_handoff(dep: Deployment) -> None:
    bad, good = dep.by_role("prefill")
    bad.script(fail_first=100, fail_status=500)
    for i in range(2):  # round robin: one of the two starts on the failing prefill
        assert len(complete(dep, prompt=f"r{i}").choices[0].text.split()) == 3
    assert bad.count("scripted_failures") == 1 and good.count("prefill") == 2
    [failed] = transfer_ids(bad, "prefill")
    wait_until(lambda: handoff_state(dep, failed) == "ABORTED", what="the failed attempt's handoff aborted")
    for tid in transfer_ids(good, "prefill"):
        assert handoff_state(dep, tid) == "DONE"


def test_prefill_timeout_is_retried_and_the_hung_request_is_cancelled(dep: Deployment) -> None:
    hung, good = dep.by_role("prefill")
    hung.script(hang=True)
    for i in range(2):
        complete(dep, prompt=f"t{i}")
    timed_out = hung.count("prefill")
    assert timed_out >= 1 and good.count("prefill") == 2
    wait_until(lambda: hung.count("cancelled") == timed_out, what="the hung prefill to see its requests cancelled")


def test_every_prefill_failing_is_pd_prefill_failed(dep: Deployment) -> None:
    for p in dep.by_role("prefill"):
        p.script(fail_first=100, fail_status=503)
    r = HTTP.post(dep.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 502 and r.headers["x-pdgate-error"] == "pd_prefill_failed"
    err = r.json()["error"]
    assert err["code"] == "pd_prefill_failed" and err["param"] is None and "503" in err["message"]
    decodes = dep.by_role("decode")
    assert sum(d.count("requests") for d in decodes) == 0, [d.stats(log=True) for d in decodes]


def test_every_prefill_timing_out_is_pd_upstream_timeout(dep: Deployment) -> None:
    for p in dep.by_role("prefill"):
        p.script(hang=True)
    with pytest.raises(openai.APIStatusError) as info:
        complete(dep)
    assert info.value.status_code == 504 and info.value.code == "pd_upstream_timeout"


def test_prefill_without_kv_params_is_pd_prefill_failed(dep: Deployment) -> None:
    for p in dep.by_role("prefill"):
        p.script(no_kv_params=True)
    with pytest.raises(openai.InternalServerError) as info:
        complete(dep)
    assert info.value.code == "pd_prefill_failed" and "kv_transfer_params" in info.value.message


def test_prefill_4xx_is_the_clients_error(dep: Deployment) -> None:
    for p in dep.by_role("prefill"):
        p.script(fail_first=1, fail_status=400)
    with pytest.raises(openai.BadRequestError) as info:
        complete(dep)
    assert info.value.code == "upstream_rejected" and "scripted failure" in info.value.message  # the engine's words
    assert sum(p.count("requests") for p in dep.by_role("prefill")) == 1


def test_decode_failing_before_its_first_byte_is_retried_without_a_second_prefill(dep: Deployment) -> None:
    bad, good = dep.by_role("decode")
    bad.script(fail_first=100, fail_status=503)
    for i in range(2):  # round robin: one of the two starts on the failing decode
        stream = dep.openai().completions.create(model="sim-model", prompt=f"d{i}", max_tokens=4, stream=True)
        assert len("".join(c.choices[0].text for c in stream if c.choices).split()) == 4
    assert sum(p.count("prefill") for p in dep.by_role("prefill")) == 2  # one prefill per request, no more
    [retried] = transfer_ids(bad, "decode")
    assert retried in transfer_ids(good, "decode")  # the same handoff, claimed by the second decode
    assert handoff_state(dep, retried) == "DONE"


def test_decode_dying_mid_stream_raises_a_typed_error_in_the_openai_client(dep: Deployment) -> None:
    for d in dep.by_role("decode"):
        d.script(die_after_tokens=2)
    stream = dep.openai().completions.create(model="sim-model", prompt="die", max_tokens=8, stream=True)
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got.append(chunk.choices[0].text)
    assert len(got) == 2 and info.value.code == "pd_decode_failed"


def test_a_router_bug_mid_stream_ends_the_stream_with_a_typed_error_event(
    dep: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last-resort handler: an unexpected exception after the stream started still ends it with the
    OpenAI error event (internal_error), not a stream cut without one."""
    import pdgate.router.attempts as attempts

    async def buggy_relay(send, resp, data, headers, *args, **kw):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first = data.split(b"\n\n")[0] + b"\n\n"  # the decode's first event only
        await send({"type": "http.response.body", "body": first, "more_body": True})
        raise RuntimeError("a bug in the relay")

    monkeypatch.setattr(attempts, "relay_stream", buggy_relay)
    stream = dep.openai().completions.create(model="sim-model", prompt="bug", max_tokens=8, stream=True)
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got.append(chunk.choices[0].text)
    assert len(got) >= 1 and info.value.code == "internal_error"
    assert "internal router error: RuntimeError" in info.value.message


def test_decode_dying_after_headers_without_stream_is_a_typed_json_error(dep: Deployment) -> None:
    for d in dep.by_role("decode"):
        d.script(die_after_tokens=0)
    r = HTTP.post(dep.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 502 and r.json()["error"]["code"] == "pd_decode_failed"
    assert r.headers["x-pdgate-error"] == "pd_decode_failed"


def test_the_routers_claim_holds_the_kv_for_a_decode_slower_than_the_ready_lease(dep: Deployment) -> None:
    """The router claims for the decode it picked as soon as the prefill answers: from then on the claim
    lease, not the READY lease, bounds how long the decode may take to reach the KV."""
    for d in dep.by_role("decode"):
        d.script(decode_delay=1.0)  # the READY lease is 0.5 s in this deployment; the claim lease 10 s
    complete(dep)
    [tid] = [t for p in dep.by_role("prefill") for t in transfer_ids(p, "prefill")]
    assert handoff_state(dep, tid) == "DONE"
    assert sum(d.count("router_claims") for d in dep.by_role("decode")) == 1  # no claim of its own


def test_decode_too_late_for_the_claim_lease_is_pd_kv_expired(dep: Deployment) -> None:
    for d in dep.by_role("decode"):
        d.script(decode_delay=1.5)
    # Its own ledger: a claim lapses after 0.2 s, back to READY, which expires 0.5 s later.
    meta = MetaSettings(ready_lease_s=0.5, claim_lease_s=0.2, sweep_interval_s=0.05)
    with static_router(dep, meta_settings=meta) as r:
        r.wait_available(*(s.id for s in dep.sims))
        with pytest.raises(openai.APIStatusError) as info:
            r.openai().completions.create(model="sim-model", prompt="late", max_tokens=2)
        assert info.value.status_code == 504 and info.value.code == "pd_kv_expired"
        [tid] = [t for p in dep.by_role("prefill") for t in transfer_ids(p, "prefill")]
        assert str(HTTP.get(f"{r.url}/v1/handoffs/{tid}").json()["state"]) == "EXPIRED"


def test_client_disconnect_during_prefill_aborts_everything(dep: Deployment) -> None:
    for p in dep.by_role("prefill"):
        p.script(hang=True)
    sock = send_raw(dep.url, {"model": "sim-model", "prompt": "bye", "max_tokens": 2})
    wait_until(lambda: sum(sum(p.stats()["inflight"]) for p in dep.by_role("prefill")) == 1, what="prefill in flight")
    [tid] = [t for p in dep.by_role("prefill") for t in transfer_ids(p, "prefill")]
    sock.close()
    wait_until(lambda: handoff_state(dep, tid) == "ABORTED", what="handoff aborted after the disconnect")
    wait_until(lambda: sum(p.count("cancelled") for p in dep.by_role("prefill")) == 1, what="prefill cancelled")


def test_client_disconnect_during_decode_aborts_everything(dep: Deployment) -> None:
    for d in dep.by_role("decode"):
        d.script(hang=True)
    sock = send_raw(dep.url, {"model": "sim-model", "prompt": "bye", "max_tokens": 2, "stream": True})
    wait_until(lambda: sum(sum(d.stats()["inflight"]) for d in dep.by_role("decode")) == 1, what="decode in flight")
    [tid] = [t for d in dep.by_role("decode") for t in transfer_ids(d, "decode")]
    assert handoff_state(dep, tid) == "CLAIMED"  # by the router, for the decode it picked
    sock.close()
    wait_until(lambda: handoff_state(dep, tid) == "ABORTED", what="handoff aborted after the disconnect")
    wait_until(lambda: sum(d.count("cancelled") for d in dep.by_role("decode")) == 1, what="decode cancelled")


def static_router(dep: Deployment, **settings: object) -> Deployment:
    """Another router, with the module's sims as static instances (its own embedded ledger)."""
    prefill = [s.url for s in dep.by_role("prefill")]
    decode = [s.url for s in dep.by_role("decode")]
    return Deployment(prefill=prefill, decode=decode, **{"whole_on_failure": False, "max_resumes": 0, **settings})


def test_static_instances_learn_their_model_and_use_the_routers_ledger(dep: Deployment) -> None:
    with static_router(dep) as r:
        r.wait_available(*(s.id for s in dep.sims))
        assert [m.id for m in r.openai().models.list().data] == ["sim-model"]
        out = r.openai().completions.create(model="sim-model", prompt="static", max_tokens=2)
        assert len(out.choices[0].text.split()) == 2
        [tid] = [t for d in dep.by_role("decode") for t in transfer_ids(d, "decode")]
        assert HTTP.get(f"{r.url}/v1/handoffs/{tid}").json()["state"] == "DONE"
    assert sum(s.count("mismatches") for s in dep.sims) == 0


def test_admission_bound_answers_429_with_retry_after(dep: Deployment) -> None:
    for d in dep.by_role("decode"):
        d.script(hang=True)
    with static_router(dep, max_inflight=1) as r:
        r.wait_available(*(s.id for s in dep.sims))
        sock = send_raw(r.url, {"model": "sim-model", "prompt": "first", "max_tokens": 2})
        wait_until(lambda: sum(sum(d.stats()["inflight"]) for d in dep.by_role("decode")) == 1, what="decode in flight")
        second = HTTP.post(r.url + "/v1/completions", json={"model": "sim-model", "prompt": "x"})
        sock.close()
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "pd_overloaded" and second.headers["x-pdgate-error"] == "pd_overloaded"


def test_api_keys(dep: Deployment) -> None:
    with static_router(dep, api_key=["k1", "k2"]) as r:
        r.wait_available(*(s.id for s in dep.sims))
        with pytest.raises(openai.AuthenticationError) as info:
            r.openai(api_key="wrong").completions.create(model="sim-model", prompt="x", max_tokens=1)
        assert info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            r.openai(api_key="wrong").models.list()
        assert r.openai(api_key="k2").completions.create(model="sim-model", prompt="x", max_tokens=1).choices
        assert httpx.get(r.url + "/health").status_code == 200  # ops routes stay open

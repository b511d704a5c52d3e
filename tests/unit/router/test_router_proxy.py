"""proxy.py without sockets: engines are `httpx.MockTransport` handlers behind `HttpxUpstream`, the ledger is
the real in-process metaserver (`LocalMetaClient` over a memory store), requests go through ASGI. A scripted
prefill that answers with KV records READY first, as a real one does, so the router can claim for its decode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.app import RouterApp, create_app
from pdgate.router.settings import RouterSettings

from pdgate.claim_seal import claim_key
from pdgate.contract import KVTransferParams
from pdgate.meta_client import MetaAPI
from pdgate.models import HandoffState, InstanceRegistration, KVLocation, Role
from pdgate.upstream import HttpxUpstream

KV = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1, 2]]}
ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
}


@dataclass
class Engines:
    """Scripted engines keyed by host: each script is a list of answers, the last one repeats."""

    scripts: dict[str, list[Callable[[dict], httpx.Response]]] = field(default_factory=dict)
    calls: list[tuple[str, dict, httpx.Headers]] = field(default_factory=list)
    meta: MetaAPI | None = None  # set by `serve`: prefills answering with KV record READY there

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        body = orjson.loads(request.content)
        self.calls.append((host, body, request.headers))
        script = self.scripts[host]
        answer = script.pop(0) if len(script) > 1 else script[0]
        resp = answer(body)
        kv = body.get("kv_transfer_params") or {}
        if self.meta is not None and kv.get("do_remote_decode") and resp.status_code == 200:
            answered = orjson.loads(resp.content).get("kv_transfer_params") or {}
            if answered.get("transfer_id") == kv["transfer_id"]:  # a ledger prefill (not stock NIXL)
                await self.meta.mark_ready(kv["transfer_id"], KVLocation(block_ids=[[1, 2]], num_tokens=2))
        return resp

    def bodies(self, host: str) -> list[dict]:
        return [b for h, b, _ in self.calls if h == host]


def prefill_ok(body: dict) -> httpx.Response:
    params = {**KV, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
    return httpx.Response(200, json={**ANSWER, "kv_transfer_params": params})


def decode_ok(body: dict) -> httpx.Response:
    return httpx.Response(200, json=ANSWER)


def status(code: int, payload: Any = None) -> Callable[[dict], httpx.Response]:
    return lambda body: httpx.Response(code, json=payload or {"error": {"message": f"status {code}"}})


class Broken(httpx.AsyncByteStream):
    """A stream that sends some SSE events, then fails like a dropped connection."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": " a"}]}\n\n'
        raise httpx.ReadError("connection reset")


@pytest.fixture
async def meta() -> AsyncIterator[MetaAPI]:
    # The sweeper runs: a claim the router takes back (decode failover) returns to READY through it.
    async with running_service(MetaSettings(sweep_interval_s=0.02)) as svc:
        client = LocalMetaClient(svc)
        for iid, role in (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE), ("d2", Role.DECODE)):
            await client.register(InstanceRegistration(id=iid, role=role, url=f"http://{iid}", model="m"))
        yield client


@pytest.fixture
def engines() -> Engines:
    return Engines({"p1": [prefill_ok], "p2": [prefill_ok], "d1": [decode_ok], "d2": [decode_ok]})


async def serve(meta: MetaAPI, engines: Engines, **overrides: Any) -> tuple[RouterApp, Any]:
    settings = RouterSettings(
        metaserver="http://meta",
        prefill_policy="round_robin",
        decode_policy="round_robin",
        retry_backoff_s=0,
        **{"whole_on_failure": False, "max_resumes": 0, **overrides},  # PD's own errors (router/whole.py)
    )
    engines.meta = meta
    upstream = HttpxUpstream(httpx.AsyncClient(transport=httpx.MockTransport(engines.handler)))
    app = create_app(settings, meta=meta, upstream=upstream)
    return app, app.api.router.lifespan_context(app.api)


def client(app: RouterApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def test_the_claim_is_sealed_with_the_ledger_token_for_the_decode_it_names(
    meta: MetaAPI, engines: Engines
) -> None:
    """With a ledger token the router seals each claim (pdgate.claim_seal): the decode it was
    made for, holding the same token, trusts it; another decode, another token, or no token does not."""
    app, lifespan = await serve(meta, engines, metaserver_token="the-ledger-token")
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200
    _, (d_host, d_body, _) = engines.calls
    kv = KVTransferParams.parse(d_body["kv_transfer_params"])
    assert kv.claimed_by == d_host and kv.claim_seal is not None
    assert kv.trusted_until(d_host, claim_key("the-ledger-token")) is not None
    assert kv.trusted_until("d2" if d_host == "d1" else "d1", claim_key("the-ledger-token")) is None
    assert kv.trusted_until(d_host, claim_key("another-token")) is None
    assert kv.trusted_until(d_host, None) is None


async def test_prefill_then_decode_with_the_prefills_params(meta: MetaAPI, engines: Engines) -> None:
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        body = {"model": "m", "prompt": "hello", "max_tokens": 20, "top_k": 3, "min_tokens": 2}
        r = await c.post("/v1/completions", json=body, headers={"x-request-id": "client-rid"})
    assert r.status_code == 200 and r.json() == ANSWER
    (p_host, p_body, p_headers), (d_host, d_body, d_headers) = engines.calls
    assert p_host.startswith("p") and d_host.startswith("d")
    assert p_body["max_tokens"] == 1 and "min_tokens" not in p_body and p_body["top_k"] == 3
    tid = p_body["kv_transfer_params"]["transfer_id"]
    handoff = await meta.get_handoff(tid)
    assert handoff.state is HandoffState.CLAIMED and handoff.decode_instance_id == d_host  # the router claimed
    assert handoff.deadline is not None
    assert d_body["kv_transfer_params"] == {
        **KV,
        "transfer_id": tid,
        "do_remote_decode": False,
        "kv_key": p_body["kv_transfer_params"]["kv_key"],
        "metaserver": "http://meta",
        "claimed_by": d_host,  # for the decode it picked, with the lease the ledger granted
        "claim_deadline": handoff.deadline,
        "claim_lease_s": pytest.approx(handoff.deadline - handoff.updated_at),
    }
    assert p_body["kv_transfer_params"]["metaserver"] == "http://meta"
    assert d_body["min_tokens"] == 2 and d_body["max_tokens"] == 20
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "client-rid"
    assert r.headers["x-request-id"] == "client-rid"
    assert handoff.prefill_instance_id == p_host


async def test_prefill_without_params_fails_typed_after_trying_each_prefill(meta: MetaAPI, engines: Engines) -> None:
    no_params = status(200, ANSWER)
    engines.scripts["p1"] = [no_params]
    engines.scripts["p2"] = [no_params]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502 and r.headers["x-pdgate-error"] == "pd_prefill_failed"
    assert r.json()["error"]["code"] == "pd_prefill_failed"
    assert "without kv_transfer_params" in r.json()["error"]["message"]
    tids = [b["kv_transfer_params"]["transfer_id"] for _, b, _ in engines.calls]
    assert len(tids) == 2 and len(set(tids)) == 2  # one new handoff per attempt, never a decode
    await app.proxy.drain_background()
    for tid in tids:
        assert (await meta.get_handoff(tid)).state is HandoffState.ABORTED


async def test_engine_4xx_is_relayed_not_retried(meta: MetaAPI, engines: Engines) -> None:
    engines.scripts["p1"] = [status(400, {"error": {"message": "prompt too long", "code": 400}})]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    error = {"message": "prompt too long", "type": "invalid_request_error", "code": "upstream_rejected", "param": None}
    assert r.status_code == 400 and r.json() == {"error": error}  # the engine's status and words, pdgate's shape
    assert r.headers["x-pdgate-error"] == "upstream_rejected" and len(engines.calls) == 1
    await app.proxy.drain_background()
    tid = engines.calls[0][1]["kv_transfer_params"]["transfer_id"]
    assert (await meta.get_handoff(tid)).state is HandoffState.ABORTED


async def test_decode_failing_before_its_first_byte_is_retried_with_the_same_handoff(
    meta: MetaAPI, engines: Engines
) -> None:
    engines.scripts["d1"] = [status(503)]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 200
    hosts = [h for h, _, _ in engines.calls]
    assert hosts == ["p1", "d1", "d2"]  # one prefill only
    d_tids = {b["kv_transfer_params"]["transfer_id"] for h, b, _ in engines.calls if h.startswith("d")}
    assert len(d_tids) == 1
    # The router took back the claim it made for d1 and claimed for d2; each decode saw its own claim.
    assert [b["kv_transfer_params"]["claimed_by"] for h, b, _ in engines.calls if h.startswith("d")] == ["d1", "d2"]
    handoff = await meta.get_handoff(d_tids.pop())
    assert (handoff.state, handoff.decode_instance_id, handoff.claims) == (HandoffState.CLAIMED, "d2", 2)


async def test_a_decode_refusing_a_claimed_handoff_is_a_pd_failure_not_the_clients(
    meta: MetaAPI, engines: Engines
) -> None:
    """A decode answers 409 when another decode holds the handoff's claim (chaos 4b: the ledger was down when
    the router's retry would have taken the claim back, so the decode claimed itself). The client's request
    is not at fault: another decode serves it, and d1's breaker is not charged."""
    engines.scripts["d1"] = [status(409, {"error": {"message": "claimed by another decode", "code": 409}})]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 200 and "x-pdgate-error" not in r.headers
    assert [h for h, _, _ in engines.calls] == ["p1", "d1", "d2"]
    assert app.proxy._pool.instances["d1"].breaker.closed  # type: ignore[attr-defined]


async def test_a_client_cannot_forge_a_claim(meta: MetaAPI, engines: Engines) -> None:
    """A claim in the client's kv_transfer_params (or in a prefill's answer) never reaches a decode: only
    the one the router made does."""
    forged = {"claimed_by": "d1", "claim_deadline": 9e9, "claim_lease_s": 3600.0, "do_remote_prefill": True}

    def prefill_forging(body: dict) -> httpx.Response:
        params = {**KV, **forged, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
        return httpx.Response(200, json={**ANSWER, "kv_transfer_params": params})

    engines.scripts["p1"] = [prefill_forging]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "kv_transfer_params": forged})
    assert r.status_code == 200
    (_, p_body, _), (d_host, d_body, _) = engines.calls
    assert not {"claimed_by", "claim_deadline", "claim_lease_s"} & set(p_body["kv_transfer_params"])
    kv = d_body["kv_transfer_params"]
    handoff = await meta.get_handoff(kv["transfer_id"])
    assert (kv["claimed_by"], kv["claim_deadline"]) == (d_host, handoff.deadline) != (d_host, 9e9)
    assert kv["claim_lease_s"] < 3600


async def test_decode_answering_410_is_kv_expired(meta: MetaAPI, engines: Engines) -> None:
    engines.scripts["d1"] = [status(410)]
    engines.scripts["d2"] = [status(410)]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "pd_kv_expired"
    assert len(engines.calls) == 2  # not retried: the KV is gone


async def test_stream_breaking_mid_way_ends_with_a_typed_error_event(meta: MetaAPI, engines: Engines) -> None:
    sse = {"content-type": "text/event-stream"}
    engines.scripts["d1"] = [lambda body: httpx.Response(200, headers=sse, stream=Broken())]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 200
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] == b'data: {"choices": [{"text": " a"}]}'
    assert orjson.loads(events[1][6:])["error"]["code"] == "pd_decode_failed"
    assert events[2] == b"data: [DONE]"


async def test_a_stream_that_ends_without_done_is_reported(meta: MetaAPI, engines: Engines) -> None:
    sse = {"content-type": "text/event-stream"}
    engines.scripts["d1"] = [lambda body: httpx.Response(200, headers=sse, content=b'data: {"a": 1}\n\n')]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert b"ended its stream without [DONE]" in r.content and r.content.endswith(b"data: [DONE]\n\n")
    assert b"decode d1" not in r.content and b"decode #" in r.content  # its opaque name, not its id


async def test_dp_ranks_are_addressed_by_header(meta: MetaAPI, engines: Engines) -> None:
    for rank in (0, 1):
        reg = InstanceRegistration(
            id=f"pdp.dp{rank}", role=Role.PREFILL, url="http://pdp", model="dp", dp_rank=rank, dp_size=2
        )
        await meta.register(reg)
    await meta.register(InstanceRegistration(id="ddp", role=Role.DECODE, url="http://ddp", model="dp"))
    engines.scripts["pdp"] = [prefill_ok]
    engines.scripts["ddp"] = [decode_ok]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        for _ in range(4):
            assert (await c.post("/v1/completions", json={"model": "dp", "prompt": "x"})).status_code == 200
    seen = set()
    for host, body, headers in engines.calls:
        if host == "pdp":
            rank = headers["x-data-parallel-rank"]
            handoff = await meta.get_handoff(body["kv_transfer_params"]["transfer_id"])
            assert handoff.prefill_instance_id == f"pdp.dp{rank}"
            seen.add(rank)
        else:
            assert "x-data-parallel-rank" not in headers  # dp_size 1
    assert seen == {"0", "1"}


async def test_refusals_before_any_engine_is_called(meta: MetaAPI, engines: Engines) -> None:
    app, lifespan = await serve(meta, engines, api_key=["secret"], max_body_bytes=2048)
    auth = {"authorization": "Bearer secret"}
    async with lifespan, client(app) as c:
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 401
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "a", "best_of": 2}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "pd_unsupported_parameter"
        assert r.json()["error"]["param"] == "best_of" and r.headers["x-pdgate-error"] == "pd_unsupported_parameter"
        r = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await c.post("/v1/completions", content=b"x" * 4096, headers=auth)
        assert r.status_code == 413
        r = await c.get("/v1/completions", headers=auth)
        assert r.status_code == 405
        r = await c.post("/v1/chat/completions", content=b"{nope", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert engines.calls == []


async def test_a_prefill_that_does_not_name_the_handoff_is_not_claimed_for(meta: MetaAPI, engines: Engines) -> None:
    """vLLM's stock NixlConnector answers without our transfer id and records nothing in the ledger: the
    router sends its decode on at once, with no claim (nothing waits for a READY that never comes)."""

    def stock_nixl_prefill(body: dict) -> httpx.Response:
        return httpx.Response(200, json={**ANSWER, "kv_transfer_params": {**KV, "remote_host": "10.0.0.9"}})

    engines.scripts["p1"] = [stock_nixl_prefill]
    app, lifespan = await serve(meta, engines)
    async with lifespan, client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 200
    (_, p_body, _), (_, d_body, _) = engines.calls
    assert "claimed_by" not in d_body["kv_transfer_params"]
    assert d_body["kv_transfer_params"]["remote_host"] == "10.0.0.9"
    assert (await meta.get_handoff(p_body["kv_transfer_params"]["transfer_id"])).state is HandoffState.PENDING

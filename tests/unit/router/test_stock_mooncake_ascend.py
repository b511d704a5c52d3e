"""A FAKE of vllm-ascend's MooncakeConnectorV1 (pull) pair, built from a recording of its messages: no NPU here.

The messages are written out from vllm-ascend's source (github.com/vllm-project/vllm-ascend at 182b75e,
2026-08-22), not captured from a running engine:
- its load-balance proxy (`examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py`,
  `build_prefill_request` and `assign_instances`) sends the prefill `do_remote_decode: true`, takes the
  prefill answer's `kv_transfer_params` and sends them to the decode as they came;
- the prefill's answer carries what `MooncakeConnectorScheduler.request_finished` returns
  (`vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py`): `ASCEND_PREFILL_PARAMS` below;
- its decode pulls only when `remote_block_ids` is non-empty and all of `remote_engine_id`, `remote_host`,
  `remote_port`, `remote_request_id` are present (`update_state_after_alloc`), else it logs "Got invalid
  KVTransferParams" and recomputes the prompt. `ascend_decode` below refuses such params with a 500 so
  the test fails where a real decode would silently recompute.
This is pdgate-router's default path (`--kv-protocol auto`, the one stock NIXL takes), so what is checked is
that the router forwards that answer to the decode with every key the decode reads, unchanged. What the
router does with vllm-ascend's MooncakeLayerwiseConnector (it cannot serve it) is in docs/MOONCAKE.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from pdgate.metaserver.app import running_service
from pdgate.metaserver.local import LocalMetaClient
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.app import create_app
from pdgate.router.settings import RouterSettings

from pdgate.meta_client import MetaAPI
from pdgate.models import InstanceRegistration, Role
from pdgate.upstream import HttpxUpstream

ASCEND_PREFILL_PARAMS: dict[str, Any] = {  # `request_finished`'s dict, one attention KV group, TP 2
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[17, 18, 19, 20]],
    "remote_engine_id": "2b5f0c1e-7f4a-4d55-9a55-0c7f3f2d9a11",
    "remote_request_id": "cmpl-9f1c2d3e4b5a6978-0-3a4b5c6d",
    "remote_host": "10.0.0.12",
    "remote_port": 30012,
    "remote_pcp_size": 1,
    "remote_dcp_size": 1,
    "remote_ptp_size": 2,
    "last_token_id": 1734,
    "remote_multi_nodes_meta_mapping": {"0": {"host": "10.0.0.12", "engine_id": "2b5f0c1e", "handshake_port": 30012}},
    "num_prompt_blocks": 4,
    "remote_block_size": 128,
}
PULL_NEEDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
}


class AscendPair:
    """p1 answers as vllm-ascend's prefill does; d1 checks the params as its decode's scheduler does."""

    def __init__(self) -> None:
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        body = orjson.loads(request.content)
        kv = body.get("kv_transfer_params") or {}
        if request.url.host == "p1":
            self.prefill_bodies.append(body)
            if not kv.get("do_remote_decode") or body.get("max_tokens") != 1:
                return httpx.Response(500, json={"error": {"message": "not a remote-decode prefill"}})
            return httpx.Response(200, json={**ANSWER, "kv_transfer_params": dict(ASCEND_PREFILL_PARAMS)})
        self.decode_bodies.append(body)
        if not (kv.get("do_remote_prefill") and kv.get("remote_block_ids") and all(k in kv for k in PULL_NEEDS)):
            return httpx.Response(500, json={"error": {"message": "Got invalid KVTransferParams"}})
        if body.get("stream"):
            sse = b'data: {"choices": [{"index": 0, "text": " ok"}]}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=ANSWER)


@pytest.fixture
async def meta() -> AsyncIterator[MetaAPI]:
    async with running_service(MetaSettings()) as svc:
        client = LocalMetaClient(svc)
        for iid, role in (("p1", Role.PREFILL), ("d1", Role.DECODE)):
            await client.register(InstanceRegistration(id=iid, role=role, url=f"http://{iid}", model="m"))
        yield client


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_gets_the_ascend_prefills_params_verbatim(meta: MetaAPI, stream: bool) -> None:
    pair = AscendPair()
    settings = RouterSettings(metaserver="http://meta", whole_on_failure=False, max_resumes=0, retry_backoff_s=0)
    upstream = HttpxUpstream(httpx.AsyncClient(transport=httpx.MockTransport(pair.handler)))
    app = create_app(settings, meta=meta, upstream=upstream)
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream}
    async with app.api.router.lifespan_context(app.api):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (p,), (d,) = pair.prefill_bodies, pair.decode_bodies
    assert p["kv_transfer_params"]["do_remote_decode"] is True and p["max_tokens"] == 1
    sent = d["kv_transfer_params"]
    for key, value in ASCEND_PREFILL_PARAMS.items():
        assert sent[key] == value, key  # do_remote_prefill true, do_remote_decode false, the rest as answered
    # What the router adds is its own (transfer_id, the handoff's kv_key): keys the ascend decode never reads.
    assert set(sent) - set(ASCEND_PREFILL_PARAMS) <= {"transfer_id", "kv_key", "metaserver"}
    assert d["max_tokens"] == 8 and d["stream"] is stream

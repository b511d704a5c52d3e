"""Point: every integer and every piece of free-form metadata is bounded in the model layer.

Unbounded, a 30-digit integer in `transport_addresses[].meta` is stored and then cannot be re-encoded:
`GET /v1/instances` answers 500 for everyone (memory store); a huge `num_tokens` on Redis commits READY
and then answers 500 on every later read and claim of that handoff.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.security.conftest import Serve, registration

HUGE = 10**30


async def _ready_body(http: httpx.AsyncClient) -> str:
    return str((await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"])


async def test_huge_integer_in_metadata_is_refused_and_reads_stay_up(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/v1/instances", json=registration("ok"))).status_code == 200
        bad = registration("evil", transport_addresses=[{"meta": {"n": HUGE}}])
        resp = await http.post("/v1/instances", json=bad)
        assert resp.status_code == 422 and "meta" in resp.json()["detail"], resp.text
        listed = await http.get("/v1/instances")
        assert listed.status_code == 200 and [i["id"] for i in listed.json()["instances"]] == ["ok"]


async def test_huge_num_tokens_is_refused_and_the_handoff_stays_usable(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        tid = await _ready_body(http)
        for field, value in [("num_tokens", HUGE), ("num_tokens", 2**53), ("block_ids", [[HUGE]])]:
            body: dict[str, Any] = {"block_ids": [[1]], "num_tokens": 1, field: value}
            resp = await http.put(f"/v1/handoffs/{tid}/ready", json=body)
            assert resp.status_code == 422 and f"body.{field}" in resp.json()["detail"], resp.text
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "PENDING"
        ok = {"block_ids": [[2**53 - 1]], "num_tokens": 2**53 - 1}
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=ok)).status_code == 200
        got = await http.get(f"/v1/handoffs/{tid}")
        assert got.status_code == 200 and got.json()["location"]["num_tokens"] == 2**53 - 1
        claim = await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d0"})
        assert claim.status_code == 200, claim.text


async def test_load_figures_and_labels_are_bounded(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/v1/instances", json=registration())).status_code == 200
        resp = await http.post("/v1/instances/p0/heartbeat", json={"load": {"running": HUGE}})
        assert resp.status_code == 422 and "body.load.running" in resp.json()["detail"]
        many = registration("p1", labels={f"k{i}": "v" for i in range(65)})
        assert (await http.post("/v1/instances", json=many)).status_code == 422
        assert (await http.get("/v1/instances")).status_code == 200


async def test_metadata_shape_is_bounded(serve: Serve) -> None:
    base = serve().url
    deep: Any = "leaf"
    for _ in range(9):
        deep = {"d": deep}
    async with httpx.AsyncClient(base_url=base) as http:
        for meta in ({"deep": deep}, {"big": "x" * (256 * 1024 + 1)}, {"many": list(range(5000))}):
            resp = await http.post("/v1/instances", json=registration(transport_addresses=[{"meta": meta}]))
            assert resp.status_code in (413, 422), resp.text
        nixl_like = {"agent": "p0-rank0", "agent_meta": "QUJD" * 4096, "regions": [[0, 1 << 40, 4096]] * 64}
        resp = await http.post("/v1/instances", json=registration(transport_addresses=[{"meta": nixl_like}]))
        assert resp.status_code == 200, resp.text


async def test_json_nested_too_deep_is_400(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        raw = b'{"prefill_instance_id": "p0", "request_id": ' + b"[" * 300 + b"]" * 300 + b"}"
        resp = await http.post("/v1/handoffs", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["code"] == "malformed_json", resp.text

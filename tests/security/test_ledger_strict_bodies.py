"""#21 finding 11, the loose half: every ledger field is read strictly, over real sockets, on both paths.

`lease_s: "10"` became 10 s, `lease_s: true` 1 s, `block_ids: [[true]]` a block id, a DONE named nobody,
and a READY could name another engine than the handoff's prefill. Each is now a 422 RFC 7807 problem that
names the field, on a single route and as a batch item (answered alone), and nothing moves.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.security.conftest import Serve, registration

READY = {"block_ids": [[1, 2]], "num_tokens": 20}


@pytest.fixture(params=[True, False], ids=["fastpath", "routes"])
def url(request: pytest.FixtureRequest, serve: Serve) -> str:
    return serve(fast_path=request.param).url


def refused(resp: httpx.Response, field: str) -> None:
    assert resp.status_code == 422, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    body = resp.json()
    assert body["code"] == "validation_error" and body["title"] and field in body["detail"], body


async def _pending(http: httpx.AsyncClient, prefill: str = "p0") -> str:
    resp = await http.post("/v1/handoffs", json={"prefill_instance_id": prefill})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["transfer_id"])


@pytest.mark.parametrize("lease", ["10", True, "1e3", False])
async def test_a_lease_that_is_not_a_number_is_refused(url: str, lease: Any) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"prefill_instance_id": "p0", "transfer_id": "loose-1", "lease_s": lease}
        refused(await http.post("/v1/handoffs", json=body), "body.lease_s")
        assert (await http.get("/v1/handoffs/loose-1")).status_code == 404
        tid = await _pending(http)
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=READY)).status_code == 200
        refused(
            await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d0", "lease_s": lease}), "lease_s"
        )
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "READY"
        refused(await http.post("/v1/instances", json=registration(lease_s=lease)), "body.lease_s")


@pytest.mark.parametrize("blocks", [[[True]], [["3"]], [[1.5]], [[-1]]])
async def test_block_ids_are_ints(url: str, blocks: Any) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        tid = await _pending(http)
        refused(await http.put(f"/v1/handoffs/{tid}/ready", json={**READY, "block_ids": blocks}), "body.block_ids.0.0")
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "PENDING"


async def test_done_names_its_decode(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        tid = await _pending(http)
        await http.put(f"/v1/handoffs/{tid}/ready", json=READY)
        assert (await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d0"})).status_code == 200
        refused(await http.post(f"/v1/handoffs/{tid}/done", json={}), "body.decode_instance_id")
        refused(await http.post(f"/v1/handoffs/{tid}/done"), "body")
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "CLAIMED"


async def test_ready_names_the_prefills_own_engine(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        reg = await http.post("/v1/instances", json=registration("p0", engine_id="eng-p0"))
        assert reg.status_code == 200, reg.text
        tid = await _pending(http)
        refused(await http.put(f"/v1/handoffs/{tid}/ready", json={**READY, "engine_id": "eng-p1"}), "body.engine_id")
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "PENDING"
        ok = await http.put(f"/v1/handoffs/{tid}/ready", json={**READY, "engine_id": "eng-p0"})
        assert ok.status_code == 200 and ok.json()["state"] == "READY"


async def test_a_batch_answers_each_loose_item_alone(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        tid = await _pending(http)
        items = [
            {"op": "create", "prefill_instance_id": "p0", "lease_s": "10"},
            {"op": "ready", "transfer_id": tid, "location": {**READY, "block_ids": [[True]]}},
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": "strict-ok"},
            {"op": "done", "transfer_id": tid},
        ]
        resp = await http.post("/v1/handoffs/batch", json={"items": items})
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert [r["status"] for r in results] == [422, 422, 201, 422]
        for r, field in zip(results, ("lease_s", "block_ids", None, "decode_instance_id"), strict=True):
            if field is not None:
                assert field in r["problem"]["detail"] and r["problem"]["code"] == "validation_error"
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "PENDING"

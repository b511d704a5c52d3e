"""#21 finding 7: routes match exactly on both paths. The fast path once matched by prefix, so
`POST /v1/handoffsXYZ` created a handoff and `POST /v1/handoffs-evil/batch` ran a batch, where FastAPI's
routes answer 404. Over real sockets, with and without the fast path."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

ServeMeta = Any


@pytest.mark.parametrize("fast_path", [True, False], ids=["fastpath", "routes"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/handoffsXYZ", {"prefill_instance_id": "p0", "transfer_id": "evil-1"}),
        (
            "/v1/handoffs-evil/batch",
            {"items": [{"op": "create", "prefill_instance_id": "p0", "transfer_id": "evil-1"}]},
        ),
        ("/v1/handoffs/", {"prefill_instance_id": "p0", "transfer_id": "evil-1"}),
    ],
)
async def test_a_path_near_a_route_is_no_route(serve_meta: ServeMeta, path: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=serve_meta().url) as http:
        resp = await http.post(path, json=body)
        assert resp.status_code == 404, resp.text
        assert resp.headers["content-type"].startswith("application/problem+json")
        problem = resp.json()
        assert (problem["status"], problem["code"], problem["title"]) == (404, "not_found", "Not Found")
        assert (await http.get("/v1/handoffs/evil-1")).status_code == 404
        assert (await http.get("/v1/instances/p0/handoff-events")).json()["events"] == []
        metrics = (await http.get("/metrics")).text
        assert "pdgate_metaserver_handoffs_created_total 0.0" in metrics

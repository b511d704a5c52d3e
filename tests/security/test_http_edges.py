"""Point: small HTTP edges of the metaserver: a trailing slash is a JSON 404 (not an empty 307 redirect),
a 405 names every allowed method in `Allow`, and the OpenAPI document lists the 400 and 413 answers."""

from __future__ import annotations

import httpx

from tests.security.conftest import Serve


async def test_trailing_slash_is_a_json_404(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        for path in ("/v1/instances/", "/v1/handoffs/", "/health/"):
            resp = await http.get(path)
            assert resp.status_code == 404, (path, resp.status_code)
            assert resp.headers["content-type"] == "application/problem+json" and resp.json()["code"] == "not_found"


async def test_405_carries_allow(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        resp = await http.patch("/v1/instances")
        assert resp.status_code == 405 and resp.json()["code"] == "method_not_allowed"
        assert set(resp.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
        resp = await http.put("/health")
        assert resp.status_code == 405 and "GET" in resp.headers["allow"]


async def test_openapi_lists_400_and_413(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        doc = (await http.get("/openapi.json")).json()
    for path, ops in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in ops.items():
            assert {"400", "401", "403", "413", "422"} <= set(op["responses"]), (method, path)
    assert "429" in doc["paths"]["/v1/instances/{instance_id}/handoff-events"]["get"]["responses"]

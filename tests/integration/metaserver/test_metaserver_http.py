"""The HTTP surface itself: races, problem documents, auth, bad input, health, metrics, docs."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.models import HandoffState, Problem
from tests.support.redis import RedisServer
from tests.support.servers import UvicornThread

ServeMeta = Any  # the `serve_meta` fixture's factory (see conftest.py)

S = HandoffState
READY_BODY = {"block_ids": [[1, 2]], "num_tokens": 20}


def problem(resp: httpx.Response, status: int, code: str) -> Problem:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    p = Problem.model_validate(resp.json())
    assert (p.status, p.code) == (status, code)
    assert p.detail and p.title
    return p


async def ready_handoff(http: httpx.AsyncClient) -> str:
    resp = await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})
    assert resp.status_code == 201
    tid = str(resp.json()["transfer_id"])
    assert (await http.put(f"/v1/handoffs/{tid}/ready", json=READY_BODY)).status_code == 200
    return tid


@pytest.fixture(params=[True, False], ids=["fastpath", "routes"])
def fast_path(request: pytest.FixtureRequest) -> bool:
    """Every case here runs against the fast path and against the plain FastAPI routes."""
    return bool(request.param)


@pytest.fixture
async def http(meta_url: str) -> Any:
    async with httpx.AsyncClient(base_url=meta_url, limits=httpx.Limits(max_connections=100)) as client:
        yield client


async def test_64_concurrent_claimers_over_http_exactly_one_wins(http: httpx.AsyncClient) -> None:
    tid = await ready_handoff(http)
    responses = await asyncio.gather(
        *(http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": f"d{i}"}) for i in range(64))
    )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] + [409] * 63
    winner = next(r for r in responses if r.status_code == 200).json()["decode_instance_id"]
    for r in responses:
        if r.status_code == 409:
            assert problem(r, 409, "illegal_transition").current_state is S.CLAIMED
    record = (await http.get(f"/v1/handoffs/{tid}")).json()
    assert record["decode_instance_id"] == winner and record["claims"] == 1


async def test_problem_documents_for_404_409_410(http: httpx.AsyncClient) -> None:
    problem(await http.get("/v1/handoffs/nope"), 404, "handoff_not_found")
    problem(await http.get("/v1/instances/nope"), 404, "instance_not_found")
    problem(await http.post("/v1/instances/nope/heartbeat", json={}), 404, "instance_not_found")
    problem(await http.get("/v1/no-such-route"), 404, "not_found")
    tid = await ready_handoff(http)
    p = problem(await http.put(f"/v1/handoffs/{tid}/ready", json=READY_BODY), 409, "illegal_transition")
    assert p.current_state is S.READY
    assert (await http.post(f"/v1/handoffs/{tid}/abort", json={"reason": "test"})).status_code == 200
    for method, path, body in [
        ("POST", "claim", {"decode_instance_id": "d0"}),
        ("POST", "done", {"decode_instance_id": "d0"}),
        ("POST", "abort", {}),
        ("PUT", "ready", READY_BODY),
    ]:
        resp = await http.request(method, f"/v1/handoffs/{tid}/{path}", json=body)
        assert problem(resp, 410, "handoff_terminal").current_state is S.ABORTED


async def test_empty_bodies_are_allowed_where_every_field_is_optional(http: httpx.AsyncClient) -> None:
    tid = await ready_handoff(http)
    assert (await http.post(f"/v1/handoffs/{tid}/abort")).json()["reason"] == "aborted"
    resp = await http.post("/v1/instances", json={"id": "e0", "role": "decode", "url": "http://h:1", "model": "m"})
    assert resp.status_code == 200
    assert (await http.post("/v1/instances/e0/heartbeat")).status_code == 200
    assert (await http.post("/v1/instances/e0/drain")).json()["state"] == "draining"
    assert (await http.delete("/v1/instances/e0")).status_code == 204


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"id": "i1", "role": "router", "url": "http://h:1", "model": "m"}, "body.role"),
        ({"id": "i1", "role": "prefill", "url": "http://h:1", "model": "m", "dp_rank": -1}, "body.dp_rank"),
        ({"id": "i1", "role": "prefill", "url": "http://h:1", "model": "m", "tp_size": "two"}, "body.tp_size"),
        ({"id": "i1", "role": "prefill", "url": "ftp://h:1", "model": "m"}, "body.url"),
        ({"id": "bad id", "role": "prefill", "url": "http://h:1", "model": "m"}, "body.id"),
        ({"id": "i1", "role": "prefill", "url": "http://h:1", "model": "m", "colour": "red"}, "body.colour"),
        ({"id": "i1", "role": "prefill", "url": "http://h:1"}, "body.model"),
        (
            {
                "id": "i1",
                "role": "prefill",
                "url": "http://h:1",
                "model": "m",
                "tp_size": 2,
                "transport_addresses": [{"tp_rank": 1}, {"tp_rank": 1}],
            },
            "transport_addresses[1].tp_rank",
        ),
    ],
)
async def test_bad_registrations_name_the_field_and_store_nothing(
    http: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    p = problem(await http.post("/v1/instances", json=body), 422, "validation_error")
    assert field in p.detail
    assert (await http.get("/v1/instances")).json() == {"instances": []}


async def test_bad_handoff_input(http: httpx.AsyncClient) -> None:
    problem(
        await http.post(
            "/v1/handoffs", content=b'{"prefill_instance_id": ', headers={"content-type": "application/json"}
        ),
        400,
        "malformed_json",
    )
    p = problem(
        await http.post("/v1/handoffs", json={"prefill_instance_id": "p0", "lease_s": -1}), 422, "validation_error"
    )
    assert "body.lease_s" in p.detail
    tid = await ready_handoff(http)
    p = problem(await http.post(f"/v1/handoffs/{tid}/claim", json={}), 422, "validation_error")
    assert "body.decode_instance_id" in p.detail
    p = problem(await http.get(f"/v1/handoffs/{tid}", params={"wait": "soon"}), 422, "validation_error")
    assert "query.wait" in p.detail
    problem(await http.get("/v1/instances/p0/handoff-events", params={"cursor": "zz"}), 400, "invalid_cursor")
    problem(await http.get("/v1/instances", params={"role": "router"}), 422, "validation_error")
    bad_ready = {"block_ids": [[1, -2]], "num_tokens": 3}
    p = problem(await http.put(f"/v1/handoffs/{tid}/ready", json=bad_ready), 422, "validation_error")
    assert "block_ids" in p.detail
    assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "READY"


async def test_oversized_bodies_get_413(serve_meta: ServeMeta) -> None:
    url = serve_meta(max_body_bytes=4096).url
    big = {"block_ids": [list(range(2000))], "num_tokens": 1}
    async with httpx.AsyncClient(base_url=url) as http:
        tid = (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"]
        problem(await http.put(f"/v1/handoffs/{tid}/ready", json=big), 413, "body_too_large")

        async def chunks() -> Any:
            for _ in range(10):
                yield b" " * 1000

        # Without a Content-Length (chunked), the bound applies while reading.
        problem(await http.put(f"/v1/handoffs/{tid}/ready", content=chunks()), 413, "body_too_large")
        assert (await http.get(f"/v1/handoffs/{tid}")).json()["state"] == "PENDING"


async def test_admin_token_guards_writes(serve_meta: ServeMeta) -> None:
    url = serve_meta(admin_token="s3cret", auth_reads=False).url
    reg = {"id": "i1", "role": "prefill", "url": "http://h:1", "model": "m"}
    async with httpx.AsyncClient(base_url=url) as http:
        resp = await http.post("/v1/instances", json=reg)
        problem(resp, 401, "unauthorized")
        assert resp.headers["www-authenticate"] == "Bearer"
        problem(
            await http.post("/v1/instances", json=reg, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized"
        )
        problem(await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"}), 401, "unauthorized")
        assert (await http.get("/v1/instances")).json() == {"instances": []}  # reads stay open, nothing written
        good = {"Authorization": "Bearer s3cret"}
        assert (await http.post("/v1/instances", json=reg, headers=good)).status_code == 200
        assert [i["id"] for i in (await http.get("/v1/instances")).json()["instances"]] == ["i1"]
        problem(await http.delete("/v1/instances/i1"), 401, "unauthorized")
        assert (await http.get("/v1/instances/i1")).status_code == 200


async def test_admin_token_guards_reads_by_default(serve_meta: ServeMeta) -> None:
    url = serve_meta(admin_token="s3cret").url
    async with httpx.AsyncClient(base_url=url) as http:
        problem(await http.get("/v1/instances"), 401, "unauthorized")
        assert (await http.get("/v1/instances", headers={"Authorization": "Bearer s3cret"})).status_code == 200


async def test_health_metrics_docs(http: httpx.AsyncClient) -> None:
    health = await http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    tid = await ready_handoff(http)
    await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d0"})
    await http.post(f"/v1/handoffs/{tid}/done", json={"decode_instance_id": "d0"})
    await http.get("/v1/handoffs/nope")
    metrics = (await http.get("/metrics")).text
    assert "pdgate_metaserver_handoffs_created_total 1.0" in metrics
    assert 'pdgate_metaserver_handoff_transitions_total{from_state="CLAIMED",to_state="DONE"} 1.0' in metrics
    assert 'route="/v1/handoffs/{transfer_id}/claim"' in metrics
    assert (
        'pdgate_metaserver_request_seconds_count{method="GET",route="/v1/handoffs/{transfer_id}",status="404"} 1.0'
        in metrics
    )
    assert "pdgate_metaserver_registry_instances" in metrics
    assert (await http.get("/docs")).status_code == 200
    spec = (await http.get("/openapi.json")).json()
    for path in (
        "/v1/instances",
        "/v1/handoffs",
        "/v1/handoffs/{transfer_id}/claim",
        "/v1/instances/{instance_id}/handoff-events",
    ):
        assert path in spec["paths"]
    claim_body = spec["paths"]["/v1/handoffs/{transfer_id}/claim"]["post"]["requestBody"]
    assert "ClaimBody" in orjson.dumps(claim_body).decode()


def gauge(metrics: str, state: str) -> float | None:
    prefix = f'pdgate_metaserver_handoffs{{state="{state}"}} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else None


async def test_metrics_show_live_handoffs_by_state(http: httpx.AsyncClient) -> None:
    tid = await ready_handoff(http)
    await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})
    metrics = (await http.get("/metrics")).text
    assert "# TYPE pdgate_metaserver_handoffs gauge" in metrics
    assert [gauge(metrics, s) for s in ("PENDING", "READY", "CLAIMED")] == [1.0, 1.0, 0.0]
    await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d0"})
    metrics = (await http.get("/metrics")).text
    assert [gauge(metrics, s) for s in ("PENDING", "READY", "CLAIMED")] == [1.0, 0.0, 1.0]
    await http.post(f"/v1/handoffs/{tid}/done", json={"decode_instance_id": "d0"})
    metrics = (await http.get("/metrics")).text
    assert [gauge(metrics, s) for s in ("PENDING", "READY", "CLAIMED")] == [1.0, 0.0, 0.0]


async def test_metrics_answer_while_the_store_is_down(fast_path: bool) -> None:
    with RedisServer() as redis:
        settings = MetaSettings(store=f"{redis.url}?prefix=down", sweep_interval_s=10, fast_path=fast_path)
        with UvicornThread(create_app(settings)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                await ready_handoff(http)
                assert gauge((await http.get("/metrics")).text, "READY") == 1.0
                redis.stop()
                resp = await http.get("/metrics")
                assert resp.status_code == 200
                assert gauge(resp.text, "READY") == 1.0  # the last value read is kept
                assert 'pdgate_metaserver_store_errors_total{kind="metrics"} 1.0' in resp.text


async def test_wait_is_capped(serve_meta: ServeMeta) -> None:
    url = serve_meta(max_wait_s=0.3).url
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        tid = (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"]
        resp = await http.get(f"/v1/handoffs/{tid}", params={"wait": 3600})
        assert resp.status_code == 200 and resp.json()["state"] == "PENDING"

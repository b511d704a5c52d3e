"""`POST /v1/handoffs/batch` over real HTTP, on the memory store and a real redis-server, with and without
the fast path: per-item outcomes, order per transfer id, hostile input, auth, and the client's call."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import orjson
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings
from starlette.responses import Response

from pdgate.meta_client import MetaClient, MetaConflict, MetaGone, MetaNotFound, MetaUnauthorized
from pdgate.models import (
    MAX_BATCH_ITEMS,
    BatchAbort,
    BatchClaim,
    BatchCreate,
    BatchDone,
    BatchReady,
    Handoff,
    HandoffState,
    KVLocation,
    Problem,
)
from tests.support.meta import uid
from tests.support.servers import UvicornThread

ServeMeta = Any  # the `serve_meta` fixture's factory (see conftest.py)
S = HandoffState
LOCATION = KVLocation(block_ids=[[1, 2]], num_tokens=20)
BATCH = "/v1/handoffs/batch"


@pytest.fixture(params=[True, False], ids=["fastpath", "routes"])
def fast_path(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
async def http(meta_url: str) -> Any:
    async with httpx.AsyncClient(base_url=meta_url) as client:
        yield client


def results(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    out: list[dict[str, Any]] = resp.json()["results"]
    return out


def item_problem(result: dict[str, Any], status: int, code: str) -> Problem:
    assert result["status"] == status, result
    p = Problem.model_validate(result["problem"])
    assert (p.status, p.code) == (status, code)
    return p


def whole_problem(resp: httpx.Response, status: int, code: str) -> Problem:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    p = Problem.model_validate(resp.json())
    assert p.code == code
    return p


async def test_full_handoffs_step_by_step_in_batches(http_client: MetaClient) -> None:
    ids = [uid("t") for _ in range(20)]
    created = await http_client.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in ids])
    assert [h.state for h in created if isinstance(h, Handoff)] == [S.PENDING] * 20
    steps = [
        [BatchReady(transfer_id=t, location=LOCATION) for t in ids],
        [BatchClaim(transfer_id=t, decode_instance_id="d0") for t in ids],
        [BatchDone(transfer_id=t, decode_instance_id="d0") for t in ids],
    ]
    for items, want in zip(steps, (S.READY, S.CLAIMED, S.DONE), strict=True):
        out = await http_client.batch(items)
        assert all(isinstance(h, Handoff) and h.state is want for h in out), out
        assert [h.transfer_id for h in out if isinstance(h, Handoff)] == ids  # answers in the items' order
    kv_keys = {h.kv_key for h in created if isinstance(h, Handoff)}
    assert len(kv_keys) == 20
    events = await http_client.events("p0")
    assert {e.transfer_id for e in events.events if e.state is S.DONE} >= set(ids)


async def test_one_transfer_id_twice_in_a_batch_runs_in_order(http: httpx.AsyncClient) -> None:
    tid = uid("t")
    body = {
        "items": [
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": tid},
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": tid},
            {"op": "ready", "transfer_id": tid, "location": LOCATION.model_dump()},
            {"op": "claim", "transfer_id": tid, "decode_instance_id": "d1"},
            {"op": "claim", "transfer_id": tid, "decode_instance_id": "d2"},
            {"op": "done", "transfer_id": tid, "decode_instance_id": "d1"},
            {"op": "done", "transfer_id": tid, "decode_instance_id": "d1"},
            {"op": "abort", "transfer_id": tid},
        ]
    }
    out = results(await http.post(BATCH, json=body))
    assert [r["status"] for r in out] == [201, 409, 200, 200, 409, 200, 410, 410]
    assert item_problem(out[1], 409, "handoff_exists").current_state is S.PENDING
    assert out[3]["handoff"]["decode_instance_id"] == "d1"
    claimed_elsewhere = item_problem(out[4], 409, "illegal_transition")
    assert "d1" in claimed_elsewhere.detail and claimed_elsewhere.instance == f"/v1/handoffs/{tid}/claim"
    assert out[5]["handoff"]["state"] == "DONE"
    assert item_problem(out[7], 410, "handoff_terminal").current_state is S.DONE


async def test_a_bad_item_never_fails_its_neighbours(http: httpx.AsyncClient) -> None:
    good = [uid("t") for _ in range(3)]
    body = {
        "items": [
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": good[0]},
            {"op": "claim", "transfer_id": "x", "decode_instance_id": 7},  # wrong type
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": good[1]},
            {"op": "teleport", "transfer_id": "x"},  # unknown op
            "not an object",
            {"op": "ready", "transfer_id": "../../etc", "location": {"block_ids": "no", "num_tokens": -1}},
            {"op": "create", "prefill_instance_id": "p0", "transfer_id": good[2], "surprise": True},  # unknown field
            {"op": "abort", "transfer_id": uid("never-created")},
            {"op": "claim", "transfer_id": good[1], "decode_instance_id": "d0", "lease_s": 1e9},
        ]
    }
    out = results(await http.post(BATCH, json=body))
    assert [r["status"] for r in out] == [201, 422, 201, 422, 422, 422, 422, 404, 422]
    assert "body.items.1" in item_problem(out[1], 422, "validation_error").detail
    assert "teleport" in item_problem(out[3], 422, "validation_error").detail
    ready = item_problem(out[5], 422, "validation_error").detail
    assert "transfer_id" in ready and "block_ids" in ready and "num_tokens" in ready
    assert "surprise" in item_problem(out[6], 422, "validation_error").detail
    item_problem(out[7], 404, "handoff_not_found")
    assert out[0]["handoff"]["transfer_id"] == good[0] and out[2]["handoff"]["transfer_id"] == good[1]
    # the refused ones left nothing behind
    assert (await http.get(f"/v1/handoffs/{good[2]}")).status_code == 404


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "malformed_json"),
        (b"", 422, "validation_error"),
        (b"[]", 422, "validation_error"),
        (b'{"items": []}', 422, "validation_error"),
        (b'{"items": {"op": "abort"}}', 422, "validation_error"),
        (b'{"items": [], "more": 1}', 422, "validation_error"),
    ],
)
async def test_a_bad_envelope_fails_the_request(http: httpx.AsyncClient, raw: bytes, status: int, code: str) -> None:
    whole_problem(await http.post(BATCH, content=raw), status, code)


async def test_batch_size_and_body_are_bounded(serve_meta: ServeMeta) -> None:
    url = serve_meta(max_body_bytes=64 * 1024).url
    async with httpx.AsyncClient(base_url=url) as http:
        too_many = {"items": [{"op": "abort", "transfer_id": f"t{i}"} for i in range(MAX_BATCH_ITEMS + 1)]}
        p = whole_problem(await http.post(BATCH, json=too_many), 413, "body_too_large")
        assert str(MAX_BATCH_ITEMS) in p.detail
        big = {"items": [{"op": "abort", "transfer_id": "t", "reason": "x" * 1000} for _ in range(100)]}
        whole_problem(await http.post(BATCH, content=orjson.dumps(big)), 413, "body_too_large")
        at_limit = {"items": [{"op": "abort", "transfer_id": f"t{i}"} for i in range(MAX_BATCH_ITEMS)]}
        out = results(await http.post(BATCH, json=at_limit))
        assert len(out) == MAX_BATCH_ITEMS and {r["status"] for r in out} == {404}


async def test_batch_needs_the_admin_token(serve_meta: ServeMeta) -> None:
    url = serve_meta(admin_token="s3cret", auth_reads=False).url  # a batch writes: guarded even with open reads
    body = {"items": [{"op": "create", "prefill_instance_id": "p0"}]}
    async with httpx.AsyncClient(base_url=url) as http:
        whole_problem(await http.post(BATCH, json=body), 401, "unauthorized")
        bad = {"Authorization": "Bearer nope"}
        whole_problem(await http.post(BATCH, json=body, headers=bad), 401, "unauthorized")
        ok = {"Authorization": "Bearer s3cret"}
        assert results(await http.post(BATCH, json=body, headers=ok))[0]["status"] == 201
    async with MetaClient(url) as anonymous:
        with pytest.raises(MetaUnauthorized):
            await anonymous.batch([BatchAbort(transfer_id="t")])


async def test_the_client_raises_each_items_own_typed_error(meta: Any) -> None:
    """MetaClient (fast path and FastAPI routes) and LocalMetaClient answer a batch alike."""
    tid, gone = uid("t"), uid("t")
    await meta.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in (tid, gone)])
    await meta.batch([BatchReady(transfer_id=tid, location=LOCATION), BatchAbort(transfer_id=gone, reason="r")])
    out = await meta.batch(
        [
            BatchClaim(transfer_id=tid, decode_instance_id="d1"),
            BatchClaim(transfer_id=tid, decode_instance_id="d2"),
            BatchClaim(transfer_id=gone, decode_instance_id="d1"),
            BatchDone(transfer_id=uid("unknown"), decode_instance_id="d1"),
        ]
    )
    assert isinstance(out[0], Handoff) and out[0].state is S.CLAIMED
    assert isinstance(out[1], MetaConflict) and out[1].current_state is S.CLAIMED
    assert isinstance(out[2], MetaGone) and out[2].current_state is S.ABORTED
    assert isinstance(out[3], MetaNotFound)
    assert await meta.batch([]) == []


async def test_concurrent_batches_race_like_single_calls(http_client: MetaClient) -> None:
    """16 decodes each send a batch claiming the same 8 handoffs: each handoff has exactly one winner."""
    ids = [uid("t") for _ in range(8)]
    await http_client.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in ids])
    await http_client.batch([BatchReady(transfer_id=t, location=LOCATION) for t in ids])
    answers = await asyncio.gather(
        *(http_client.batch([BatchClaim(transfer_id=t, decode_instance_id=f"d{d}") for t in ids]) for d in range(16))
    )
    for i in range(len(ids)):
        won = [a[i] for a in answers if isinstance(a[i], Handoff)]
        assert len(won) == 1
        assert all(isinstance(a[i], MetaConflict) for a in answers if a[i] is not won[0])


async def test_batches_are_counted_on_metrics(http: httpx.AsyncClient) -> None:
    body = {"items": [{"op": "abort", "transfer_id": uid("t")} for _ in range(5)]}
    results(await http.post(BATCH, json=body))
    text = (await http.get("/metrics")).text
    assert "pdgate_metaserver_batch_items_count 1.0" in text
    assert "pdgate_metaserver_batch_items_sum 5.0" in text
    assert 'pdgate_metaserver_batch_item_outcomes_total{op="abort",status="404"} 5.0' in text


async def test_against_a_metaserver_without_the_batch_route_the_client_sends_single_calls() -> None:
    """An older metaserver (no batch route: 404/405) still gets every call, one request each."""
    inner = create_app(MetaSettings(store="memory://", fast_path=False))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The metaserver with its batch route answering 404 (an older one): in front of the app, since
        FastAPI >= 0.14x keeps an included router's routes inside one route of `app.router.routes`."""
        if scope["type"] == "http" and scope["path"] == BATCH:
            await Response(status_code=404)(scope, receive, send)
            return
        await inner(scope, receive, send)

    with UvicornThread(app) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.post(BATCH, json={"items": []})).status_code in (404, 405)
        async with MetaClient(server.url) as client:
            tid = uid("t")
            out = await client.batch(
                [
                    BatchCreate(prefill_instance_id="p0", transfer_id=tid),
                    BatchAbort(transfer_id=uid("missing")),
                ]
            )
            assert isinstance(out[0], Handoff) and out[0].transfer_id == tid
            assert isinstance(out[1], MetaNotFound)
            ready = await client.batch([BatchReady(transfer_id=tid, location=LOCATION)])
            assert isinstance(ready[0], Handoff) and ready[0].state is S.READY


async def test_openapi_documents_the_batch_body_with_every_reference_resolvable(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    body = spec["paths"][BATCH]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ops = {variant["properties"]["op"]["const"] for variant in body["properties"]["items"]["items"]["oneOf"]}
    assert ops == {"create", "ready", "claim", "done", "abort"}
    refs = set(re.findall(r"#/components/schemas/(\w+)", orjson.dumps(spec).decode()))
    assert refs <= set(spec["components"]["schemas"])

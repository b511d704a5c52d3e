"""The router's ledger calls to a separate metaserver ride in batches (`pdgate/meta_pooled.py`, issue 12).

Real parts: a metaserver app on a real socket (memory store), the router's own `PooledMetaClient` over
its `HttpPool`, and, for the whole path, a router in front of `pdgate-sim` engines that record every
handoff in that metaserver, driven by the official `openai` client. How many batch requests the
metaserver served, and how many items they held, is read from its own /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient, MetaConflict, MetaNotFound, MetaUnavailable
from pdgate.meta_pooled import PooledMetaClient
from pdgate.models import HandoffCreate, HandoffState, KVLocation
from tests.integration.router.conftest import Deployment
from tests.support.meta import uid
from tests.support.servers import UvicornThread

N = 48
LOCATION = KVLocation(block_ids=[[1, 2]], num_tokens=20)


@pytest.fixture
def meta_url() -> Iterator[str]:
    server = UvicornThread(create_app(MetaSettings(store="memory://", sweep_interval_s=0.05))).start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def pooled(url: str, batches: int) -> AsyncIterator[MetaClient]:
    """The router's client of `url`, over its own pool, closed after the block."""
    pool = HttpPool()
    client = PooledMetaClient(url, pool=pool, batches=batches)
    try:
        yield client
    finally:
        await client.aclose()
        await pool.aclose()


def batch_stats(url: str) -> tuple[int, int]:
    """(batch requests served, items they held), from the metaserver's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text

    def value(name: str) -> int:
        m = re.search(rf"^pdgate_metaserver_batch_items_{name} (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else 0

    return value("count"), value("sum")


def batched(url: str, op: str, status: int) -> int:
    """Batch items of one operation answered with `status`, from the metaserver's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    pattern = rf'^pdgate_metaserver_batch_item_outcomes_total{{op="{op}",status="{status}"}} (\S+)$'
    m = re.search(pattern, text, re.M)
    return int(float(m.group(1))) if m else 0


async def test_concurrent_creates_and_claims_ride_in_batches(meta_url: str) -> None:
    async with pooled(meta_url, batches=1) as client:
        ids = [uid("t") for _ in range(N)]
        created = await asyncio.gather(
            *(client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=t)) for t in ids)
        )
        assert [h.transfer_id for h in created] == ids
        assert {h.state for h in created} == {HandoffState.PENDING}
        assert len({h.kv_key for h in created}) == N  # each its own record
        requests, items = batch_stats(meta_url)
        assert items == N - 1 and requests < N / 2  # the first went alone, the rest rode together

        async with MetaClient(meta_url) as plain:
            for t in ids:
                await plain.mark_ready(t, LOCATION)
        claimed = await asyncio.gather(*(client.claim(t, "d0") for t in ids))
        assert {(h.state, h.decode_instance_id) for h in claimed} == {(HandoffState.CLAIMED, "d0")}
        aborted = await asyncio.gather(*(client.abort(t, "test") for t in ids[: N // 2]))
        assert {h.state for h in aborted} == {HandoffState.ABORTED}
        more_requests, more_items = batch_stats(meta_url)
        assert more_items - items == N - 1 + N // 2 - 1 and more_requests - requests < N


async def test_a_batched_call_raises_its_single_calls_typed_error_and_spares_its_neighbours(meta_url: str) -> None:
    async with pooled(meta_url, batches=1) as client:
        taken = uid("t")
        await client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=taken))
        fresh = uid("t")
        outcomes = await asyncio.gather(
            client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=taken)),
            client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=fresh)),
            client.claim(taken, "d0"),  # still PENDING: the router's long poll needs the state
            client.abort(uid("gone"), "test"),
            return_exceptions=True,
        )
        dup, ok, pending, unknown = outcomes
        assert isinstance(dup, MetaConflict) and dup.code == "handoff_exists"
        assert not isinstance(ok, BaseException) and ok.transfer_id == fresh
        assert isinstance(pending, MetaConflict) and pending.current_state is HandoffState.PENDING
        assert isinstance(unknown, MetaNotFound)
        assert batch_stats(meta_url)[1] == 3  # the first create went alone, the other three together


async def test_a_lone_call_goes_as_its_single_route(meta_url: str) -> None:
    async with pooled(meta_url, batches=2) as client:
        for _ in range(5):  # one after the other: never another call out
            t = uid("t")
            await client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=t))
            await client.abort(t, "test")
        assert batch_stats(meta_url) == (0, 0)


async def test_no_batches_sends_each_call_on_its_own(meta_url: str) -> None:
    async with pooled(meta_url, batches=0) as client:
        ids = [uid("t") for _ in range(8)]
        await asyncio.gather(
            *(client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=t)) for t in ids)
        )
        assert batch_stats(meta_url) == (0, 0)


def _without_batch_route(app: Any) -> Any:
    """The metaserver as an older version serves it: no batch route (404, as Starlette answers)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/handoffs/batch":
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Not Found"})
            return
        await app(scope, receive, send)

    return wrapped


async def test_a_metaserver_without_the_batch_route_gets_single_calls() -> None:
    server = UvicornThread(_without_batch_route(create_app(MetaSettings(store="memory://")))).start()
    try:
        async with pooled(server.url, batches=1) as client:
            ids = [uid("t") for _ in range(N)]
            created = await asyncio.wait_for(
                asyncio.gather(
                    *(client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=t)) for t in ids)
                ),
                timeout=20,
            )
            assert [h.transfer_id for h in created] == ids and len({h.kv_key for h in created}) == N
            assert client.batch_route is False  # learnt once: later calls go single from the start
            aborted = await asyncio.gather(*(client.abort(t, "test") for t in ids))
            assert {h.state for h in aborted} == {HandoffState.ABORTED}
    finally:
        server.stop()


def _lying(app: Any, answers: dict[str, bytes]) -> Any:
    """The metaserver, except that the routes in `answers` answer 200 with that body (a lying peer)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = answers.get(scope.get("path", "")) if scope["type"] == "http" else None
        if body is None:
            await app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return wrapped


@pytest.mark.parametrize(
    "answer",
    [
        b'{"results": []}',
        b'{"results": [{"status": 201}, 7]}',
        b'{"nope": 1}',
        b"not json",
        b'{"results": [{"handoff": 1}]}',
    ],
    ids=["too-few", "not-objects", "no-results", "not-json", "bad-record"],
)
async def test_a_batch_answer_that_does_not_match_its_items_is_metaserver_unavailable_for_each(answer: bytes) -> None:
    app = _lying(create_app(MetaSettings(store="memory://")), {"/v1/handoffs/batch": answer})
    server = UvicornThread(app).start()
    try:
        async with pooled(server.url, batches=1) as client:
            outcomes = await asyncio.gather(
                *(
                    client.create_handoff(HandoffCreate(prefill_instance_id="p0", transfer_id=uid("t")))
                    for _ in range(4)
                ),
                return_exceptions=True,
            )
        assert not isinstance(outcomes[0], BaseException)  # alone: the single route, which tells the truth
        for out in outcomes[1:]:  # batched: typed, never a bare ValueError or KeyError
            assert isinstance(out, MetaUnavailable) and "cannot read" in out.detail, out
    finally:
        server.stop()


def test_a_router_in_front_of_a_lying_metaserver_answers_a_typed_503() -> None:
    """The single create route answers 200 with what is not a handoff: the client gets
    pd_metaserver_unavailable in OpenAI's error shape, not an internal error."""
    app = _lying(create_app(MetaSettings(store="memory://")), {"/v1/handoffs": b'{"transfer_id": 5}'})
    server = UvicornThread(app).start()
    dep = Deployment(metaserver=server.url, on_ledger_outage="refuse").start()  # not served whole
    try:
        dep.add_many([("prefill", ()), ("decode", ())])
        dep.wait_available(*(s.id for s in dep.sims))
        r = httpx.post(dep.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "pd_metaserver_unavailable"
    finally:
        dep.stop()
        server.stop()


async def test_router_requests_record_their_handoffs_in_batches(meta_url: str) -> None:
    dep = Deployment(metaserver=meta_url, metaserver_batches=2).start()
    try:
        dep.add_many([("prefill", ()), ("decode", ())])
        dep.wait_available(*(s.id for s in dep.sims))
        async with openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="k", max_retries=0) as client:
            outs = await asyncio.gather(
                *(client.completions.create(model="sim-model", prompt=f"b{i}", max_tokens=3) for i in range(N))
            )
        assert all(o.choices[0].text for o in outs)
        # The router's creates made while another was out went in batches (the sims batch their READY,
        # claims and DONE too, as the connector does), several calls to a batch.
        requests, items = batch_stats(meta_url)
        assert 0 < batched(meta_url, "create", 201) < N and requests < items
        assert batched(meta_url, "ready", 200) > 0 and batched(meta_url, "done", 200) > 0
        p, d = dep.sims
        assert d.count("claimed") == N and p.count("mismatches") == d.count("mismatches") == 0
    finally:
        dep.stop()

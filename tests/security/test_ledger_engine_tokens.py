"""#21 finding 11, the trust half: an engine token moves only its own instance's side of a handoff.

Every engine shared one admin token, so any engine could move any prefill's handoffs. An engine token
(`pdgate.auth.engine_token`, from the admin-only `POST /v1/instances/{id}/token`) names its instance: READY
only for its own prefill, claim and DONE only for itself, on a single route and in each batch item; the
shared admin token keeps working. Over real sockets, on both paths. The last test is pure: what an engine
token means for the router's claim seals (SECURITY.md, "Claim seals under engine tokens").
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from pdgate.auth import engine_of, engine_token
from pdgate.claim_seal import claim_key
from pdgate.contract import KVTransferParams, RouterClaim, decode_request, with_claim
from tests.security.conftest import Serve, registration

ADMIN = {"Authorization": "Bearer s3cret"}
READY = {"block_ids": [[1, 2]], "num_tokens": 20}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(params=[True, False], ids=["fastpath", "routes"])
def url(request: pytest.FixtureRequest, serve: Serve) -> str:
    return serve(fast_path=request.param, admin_token="s3cret").url


async def _token(http: httpx.AsyncClient, instance_id: str) -> dict[str, str]:
    resp = await http.post(f"/v1/instances/{instance_id}/token", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    assert resp.json()["instance_id"] == instance_id
    return bearer(resp.json()["token"])


def forbidden(resp: httpx.Response) -> None:
    assert resp.status_code == 403, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert resp.json()["code"] == "forbidden"


async def _created(http: httpx.AsyncClient, prefill: str) -> str:
    resp = await http.post("/v1/handoffs", json={"prefill_instance_id": prefill}, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["transfer_id"])


def test_an_engine_token_names_its_instance_and_cannot_be_forged() -> None:
    token = engine_token("s3cret", "p.0:a")
    assert engine_of(token, "s3cret") == "p.0:a"
    assert engine_of(token, "other") is None
    assert engine_of(token.replace("p.0:a", "p.0:b"), "s3cret") is None
    assert engine_of("s3cret", "s3cret") is None and engine_of(None, "s3cret") is None


async def test_ready_only_for_its_own_prefill(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        a, b = await _token(http, "pA"), await _token(http, "pB")
        tid = await _created(http, "pB")
        forbidden(await http.put(f"/v1/handoffs/{tid}/ready", json=READY, headers=a))
        assert (await http.get(f"/v1/handoffs/{tid}", headers=ADMIN)).json()["state"] == "PENDING"
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=READY, headers=b)).status_code == 200


async def test_claim_and_done_only_for_itself(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        d1 = await _token(http, "d1")
        tid = await _created(http, "pA")
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=READY, headers=ADMIN)).status_code == 200
        forbidden(await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d2"}, headers=d1))
        assert (await http.get(f"/v1/handoffs/{tid}", headers=ADMIN)).json()["state"] == "READY"
        assert (
            await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d1"}, headers=d1)
        ).status_code == 200
        forbidden(await http.post(f"/v1/handoffs/{tid}/done", json={"decode_instance_id": "d2"}, headers=d1))
        done = await http.post(f"/v1/handoffs/{tid}/done", json={"decode_instance_id": "d1"}, headers=d1)
        assert done.status_code == 200 and done.json()["state"] == "DONE"


async def test_each_batch_item_is_held_to_the_token(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        a = await _token(http, "pA")
        mine, theirs = await _created(http, "pA"), await _created(http, "pB")
        items = [
            {"op": "ready", "transfer_id": theirs, "location": READY},
            {"op": "ready", "transfer_id": mine, "location": READY},
            {"op": "create", "prefill_instance_id": "pB"},
            {"op": "claim", "transfer_id": mine, "decode_instance_id": "d9"},
        ]
        resp = await http.post("/v1/handoffs/batch", json={"items": items}, headers=a)
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert [r["status"] for r in results] == [403, 200, 403, 403]
        assert results[0]["problem"]["code"] == "forbidden"
        assert (await http.get(f"/v1/handoffs/{theirs}", headers=ADMIN)).json()["state"] == "PENDING"


async def test_an_engine_registers_only_itself_and_cannot_mint_tokens(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        a = await _token(http, "pA")
        assert (await http.post("/v1/instances", json=registration("pA"), headers=a)).status_code == 200
        forbidden(await http.post("/v1/instances", json=registration("pB"), headers=a))
        forbidden(await http.post("/v1/instances/pA/heartbeat", json={}, headers=await _token(http, "pB")))
        forbidden(await http.post("/v1/instances/pB/token", headers=a))
        resp = await http.post("/v1/instances/pB/token", headers=bearer("wrong"))
        assert resp.status_code == 401


async def test_the_shared_admin_token_still_moves_anything(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        tid = await _created(http, "pB")
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=READY, headers=ADMIN)).status_code == 200
        claim = await http.post(f"/v1/handoffs/{tid}/claim", json={"decode_instance_id": "d7"}, headers=ADMIN)
        assert claim.status_code == 200
        done = await http.post(f"/v1/handoffs/{tid}/done", json={"decode_instance_id": "d7"}, headers=ADMIN)
        assert done.json()["state"] == "DONE"


def _sealed_params(key: bytes | None) -> KVTransferParams:
    """A decode's params carrying the router's claim for d-1, sealed under `key`, as the decode parses them."""
    claim = RouterClaim("d-1", time.time() + 10, 10.0).sealed(key, transfer_id="t-1", location=None)
    answer = {"do_remote_decode": True, "remote_block_ids": [4, 5], "kv_key": 7}
    return KVTransferParams.parse(
        orjson.loads(orjson.dumps(with_claim(decode_request(answer, "t-1", kv_key=7), claim)))
    )


def test_a_decode_holding_an_engine_token_trusts_no_router_seal_and_cannot_make_one() -> None:
    """What SECURITY.md says of claim seals under engine tokens: the router seals with the admin token's
    key, a decode's connector derives its key from its own token (`claim_seal.claim_key`), so under an
    engine token no router seal matches (it claims through the ledger instead), and a seal made with an
    engine token's key is no seal for a decode holding the admin token."""
    admin_key, engine_key = claim_key("s3cret"), claim_key(engine_token("s3cret", "d-1"))
    assert admin_key is not None and engine_key is not None
    by_router = _sealed_params(admin_key)
    assert by_router.trusted_until("d-1", admin_key) is not None  # the shared token: trusted, no ledger call
    assert by_router.trusted_until("d-1", engine_key) is None  # an engine token: not trusted
    assert _sealed_params(engine_key).trusted_until("d-1", admin_key) is None  # an engine cannot seal

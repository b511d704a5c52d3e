"""`pdgate drain` / `undrain` and `pdgate handoffs` against a metaserver on a real redis-server and on
the memory store: the store's drain script sets the state it is given; live handoffs are listed from
each shard's deadlines, the nearest lease end first."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.cli.conftest import TOKEN, metaserver, pdgate
from tests.integration.router.conftest import start_sims
from tests.support.meta import store_url
from tests.support.ports import wait_until
from tests.support.redis import RedisServer


def test_drain_and_undrain_on_redis(redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    server = metaserver(store=store_url("redis", redis_server))
    [sim] = start_sims([("decode", ["--admin-token", TOKEN])], metaserver=server.url)
    conn = ("--metaserver", server.url, "--token", TOKEN, "--json")
    try:
        wait_until(lambda: len(json.loads(pdgate(capsys, "instances", *conn)[1])) == 1, what="the sim registered")
        code, out, _ = pdgate(capsys, "drain", sim.id, *conn)
        assert code == 0 and json.loads(out)["state"] == "draining"
        # The sim's heartbeats and re-registrations keep the operator's drain.
        [row] = json.loads(pdgate(capsys, "instances", *conn)[1])
        assert row["state"] == "draining"
        code, out, _ = pdgate(capsys, "undrain", sim.id, *conn)
        assert code == 0 and json.loads(out)["state"] == "ready"
        [row] = json.loads(pdgate(capsys, "instances", *conn)[1])
        assert row["state"] == "ready"
        code, out, _ = pdgate(capsys, "handoffs", "--counts", *conn)
        assert code == 0 and json.loads(out) == {"PENDING": 0, "READY": 0, "CLAIMED": 0}
    finally:
        sim.stop()
        server.stop()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_live_handoffs_are_listed_by_state(
    kind: str, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = metaserver(store=store_url(kind, redis_server))
    conn = ("--metaserver", server.url, "--token", TOKEN, "--json")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        made = []
        for i in range(3):  # each PENDING for the server's pending lease: their lease ends in this order
            body = {"prefill_instance_id": "p-1", "transfer_id": f"t-{i}"}
            resp = httpx.post(server.url + "/v1/handoffs", json=body, headers=auth)
            assert resp.status_code == 201, resp.text
            made.append(resp.json()["transfer_id"])
        done = {"prefill_instance_id": "p-1", "transfer_id": "t-gone"}
        assert httpx.post(server.url + "/v1/handoffs", json=done, headers=auth).status_code == 201
        assert httpx.post(server.url + "/v1/handoffs/t-gone/abort", json={}, headers=auth).status_code == 200
        code, out, _ = pdgate(capsys, "handoffs", "--state", "pending", *conn)
        assert code == 0
        assert [h["transfer_id"] for h in json.loads(out)] == ["t-0", "t-1", "t-2"]  # nearest lease end first
        _, out, _ = pdgate(capsys, "handoffs", "--limit", "2", *conn)
        assert [h["transfer_id"] for h in json.loads(out)] == ["t-0", "t-1"]
        _, out, _ = pdgate(capsys, "handoffs", "--state", "ready", *conn)
        assert json.loads(out) == []
        code, table, _ = pdgate(capsys, "handoffs", "--metaserver", server.url, "--token", TOKEN)
        assert table.split()[:3] == ["TRANSFER_ID", "STATE", "PREFILL_INSTANCE_ID"] and "t-gone" not in table
        refused = httpx.get(server.url + "/v1/handoffs?state=DONE", headers=auth)
        assert refused.status_code == 422 and "only live handoffs" in refused.text
        assert httpx.get(server.url + "/v1/handoffs", headers={"Authorization": "Bearer x"}).status_code == 401
    finally:
        server.stop()

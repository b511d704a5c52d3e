"""`pdgate drain` / `undrain` against a metaserver on a real redis-server (the store's drain script sets
the state it is given), and the handoff counts the command reads from its /metrics."""

from __future__ import annotations

import json

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
        code, out, _ = pdgate(capsys, "handoffs", *conn)
        assert code == 0 and json.loads(out) == {"PENDING": 0, "READY": 0, "CLAIMED": 0}
    finally:
        sim.stop()
        server.stop()

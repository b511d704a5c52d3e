"""Engines the router refuses say so (issue #26 item 3): a prefill and a decode registered at a metaserver
that accepts them, read by a router whose `--allowed-engine-networks` leaves their 127.0.0.1 URLs out,
used to look like "no prefill or decode instance is registered" to the client and in /health.

Real parts: a metaserver app on a real socket (memory store, no networks of its own), `pdgate-sim`
engines registered there, and a router reading that registry, over sockets with the official `openai`
client. What a client reads names the count and the reason, never an engine's address (SECURITY.md:
instance URLs are admin-only); the admin's /health names each record.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from tests.integration.router.conftest import Deployment, Sim, start_sims
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

TOKEN = "left-out-admin-token"


@pytest.fixture
def registered() -> Iterator[tuple[str, list[Sim]]]:
    """A metaserver and one prefill + one decode registered there on 127.0.0.1."""
    server = UvicornThread(create_app(MetaSettings(store="memory://", admin_token=TOKEN))).start()
    sims = start_sims([("prefill", ("--admin-token", TOKEN)), ("decode", ("--admin-token", TOKEN))], server.url)
    try:
        yield server.url, sims
    finally:
        for sim in sims:
            sim.stop()
        server.stop()


def _router(meta_url: str, networks: str) -> Deployment:
    return Deployment(metaserver=meta_url, metaserver_token=TOKEN, admin_token=TOKEN, allowed_engine_networks=networks)


def test_engines_outside_the_allowed_networks_are_named_as_left_out(registered: tuple[str, list[Sim]]) -> None:
    meta_url, sims = registered
    with _router(meta_url, "10.0.0.0/8") as d:
        wait_until(lambda: len(d.health()["left_out"]) == 2, timeout=20, what="both records left out")

        with pytest.raises(openai.APIStatusError) as caught:
            d.openai().completions.create(model="sim-model", prompt="hi", max_tokens=2)
        err = caught.value
        assert err.status_code == 503 and err.response.headers["x-pdgate-error"] == "pd_no_compatible_pair"
        message = err.response.json()["error"]["message"]
        assert "2 registered instance(s) were left out of the pool (2 outside --allowed-engine-networks)" in message
        assert "127.0.0.1" not in message and all(s.id not in message for s in sims)

        without_model = httpx.post(d.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert without_model.status_code == 503
        assert "outside --allowed-engine-networks" in without_model.json()["error"]["message"]

        anyone = httpx.get(d.url + "/health", timeout=10)
        assert anyone.status_code == 503
        public = anyone.json()
        assert "2 registered instance(s) were left out of the pool" in public["reason"]
        assert public["left_out"] == [{"model": "sim-model", "reason": "outside --allowed-engine-networks"}] * 2
        assert "127.0.0.1" not in anyone.text

        admin = d.health()
        assert {(o["id"], o["url"]) for o in admin["left_out"]} == {(s.id, s.url) for s in sims}
        assert all(s.url in admin["reason"] for s in sims)


def test_engines_inside_the_allowed_networks_serve_and_nothing_is_left_out(registered: tuple[str, list[Sim]]) -> None:
    meta_url, sims = registered
    with _router(meta_url, "127.0.0.0/8") as d:
        d.wait_available(*(s.id for s in sims))
        assert d.openai().completions.create(model="sim-model", prompt="hi", max_tokens=2).choices
        assert d.health()["left_out"] == []

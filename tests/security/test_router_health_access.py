"""`/health` shows instance URLs only to the admin, and tells the truth while the registry is down
(issue 9: "Reads that reveal internal addresses", "/health tells the truth")."""

from __future__ import annotations

import signal

import httpx

from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until
from tests.support.redis import RedisServer

TOKEN = "health-admin-token"


def test_instance_urls_are_shown_only_to_a_caller_with_the_admin_token() -> None:
    with Deployment(admin_token=TOKEN) as d:
        p, dec = d.add_many([("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")

        anonymous = httpx.get(d.url + "/health", timeout=5).json()
        admin = httpx.get(d.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()
        # Instance ids default to <host>-<port>: an anonymous caller reads each one's opaque name instead,
        # which the admin's rows pair with the id.
        assert {i["id"] for i in anonymous["instances"]} == {i["public_id"] for i in admin["instances"]}
        assert {i["id"] for i in admin["instances"]} == {p.id, dec.id}
        assert all("url" not in i and "public_id" not in i for i in anonymous["instances"])
        assert p.url not in httpx.get(d.url + "/health", timeout=5).text
        assert p.id not in httpx.get(d.url + "/health", timeout=5).text

        client_key = httpx.get(d.url + "/health", headers={"Authorization": "Bearer nope"}, timeout=5).json()
        assert all("url" not in i for i in client_key["instances"])

        admin = httpx.get(d.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()
        assert {i["url"] for i in admin["instances"]} == {p.url, dec.url}


def test_failed_health_checks_do_not_name_the_address() -> None:
    with Deployment(admin_token=TOKEN) as d:
        p, _dec = d.add_many([("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
        p.stop(signal.SIGKILL)  # no deregistration: its lease outlives it, and its probe fails to connect
        wait_until(
            lambda: any(i["id"] == p.id and not i["available"] for i in d.health()["instances"]),
            timeout=20,
            what="the dead prefill's failed health check",
        )
        text = httpx.get(d.url + "/health", timeout=5).text
        assert f":{p.port}" not in text and "connection failed" in text


def test_health_is_503_while_the_store_is_unreachable() -> None:
    with RedisServer() as redis:
        with Deployment(store=redis.url, metaserver_timeout_s=1.0, admin_token=TOKEN) as d:
            d.add_many([("prefill", ()), ("decode", ())])
            wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
            redis.stop()
            wait_until(
                lambda: httpx.get(d.url + "/health", timeout=5).status_code == 503,
                timeout=20,
                what="/health to say 503 while Redis is down",
            )
            body = d.health()
            assert body["status"] == "unavailable" and "registry cannot be read" in body["reason"]
            assert f":{redis.port}" not in httpx.get(d.url + "/health", timeout=5).text
            redis.start()
            wait_until(lambda: d.health()["status"] == "ok", timeout=30, what="/health to recover with Redis")


def test_health_is_503_while_an_external_metaserver_is_unreachable() -> None:
    """Static engines look healthy, but every request needs the ledger: /health must not say ok."""
    from tests.integration.router.conftest import start_sims
    from tests.support.ports import free_port

    sims = start_sims([("prefill", ()), ("decode", ())])
    try:
        nowhere = f"http://127.0.0.1:{free_port()}"
        with Deployment(metaserver=nowhere, prefill=[sims[0].url], decode=[sims[1].url], metaserver_timeout_s=0.5) as d:
            wait_until(lambda: d.health()["models"] == ["sim-model"], timeout=20, what="the static pair")
            got = httpx.get(d.url + "/health", timeout=5)
            assert got.status_code == 503 and "registry cannot be read" in got.json()["reason"]
    finally:
        for sim in sims:
            sim.stop()

"""One bad instance URL can never take the router down (issue 9, "Instance URLs").

Before, a registry record with port 99999 made `asyncio.gather` in the health loop fail as a whole:
health checks stopped for every instance, requests got 500, and a restarted router exited with
"Application startup failed". The record here is written straight into the store (as a record from
before the URL rule, or written by hand, would be): the registration API refuses such URLs now.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pdgate.metaserver.app import policy_from
from pdgate.metaserver.models import Instance, InstanceRegistration, Role
from pdgate.metaserver.registry import new_instance
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import open_store
from pdgate.router.settings import RouterSettings

from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until
from tests.support.redis import RedisServer


def _bad_record(url: str) -> Instance:
    now = time.time()
    reg = InstanceRegistration(id="bad", role=Role.BOTH, url="http://127.0.0.1:1", model="sim-model", lease_s=3600)
    return new_instance(reg, now=now, default_lease_s=3600).model_copy(update={"url": url})


async def _write(store_url: str, url: str) -> None:
    store = open_store(store_url, policy=policy_from(MetaSettings(store=store_url)))
    try:
        await store.register(_bad_record(url), now=time.time())
    finally:
        await store.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://" + "a" * 64 + ".example:8000"])
def test_a_bad_record_neither_stops_health_checks_nor_start_up(url: str) -> None:
    with RedisServer() as redis:
        asyncio.run(_write(redis.url, url))
        with Deployment(store=redis.url, prefill_policy="round_robin") as d:  # start-up survives it
            p1, _p2, _dec = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
            wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
            assert "bad" not in {i["id"] for i in d.health()["instances"]}
            c = d.openai()
            for i in range(8):
                assert c.completions.create(model="sim-model", prompt=f"r{i}", max_tokens=1).choices
            p1.script(unhealthy=True)  # the health loop still runs: it ejects p1
            d.wait_available(p1.id, available=False)


def test_static_urls_follow_the_registration_rule() -> None:
    for bad in ("http://127.0.0.1:99999", "http://", "http://[::1", "http://user:pw@host:80/x?y="):
        with pytest.raises(ValueError, match="instance URL"):
            RouterSettings(prefill=[bad])
    with pytest.raises(ValueError, match="outside the allowed engine networks"):
        RouterSettings(decode=["http://10.1.2.3:8000"], allowed_engine_networks="192.168.0.0/16")
    assert RouterSettings(decode=["http://10.1.2.3:8000/"], allowed_engine_networks="10.0.0.0/8").decode == [
        "http://10.1.2.3:8000"
    ]

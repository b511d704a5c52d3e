"""One bad instance URL can never take the router down (issue 9, "Instance URLs").

Before, a registry record with port 99999 made `asyncio.gather` in the health loop fail as a whole:
health checks stopped for every instance, requests got 500, and a restarted router exited with
"Application startup failed". The bad records here are written straight into the store (as a record
from before the URL rule, or written by hand, would be): the registration API refuses such URLs now.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from pdgate.metaserver.app import policy_from
from pdgate.metaserver.registry import new_instance
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import open_store
from pdgate.router.settings import RouterSettings
from pydantic import ValidationError

from pdgate.models import Instance, InstanceRegistration, Role
from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until
from tests.support.redis import RedisServer

BAD_URLS = ["http://127.0.0.1:99999", "http://" + "a" * 64 + ".example:8000", "http://[::1"]


def _bad_record(url: str, instance_id: str = "bad") -> Instance:
    reg = InstanceRegistration(
        id=instance_id, role=Role.BOTH, url="http://127.0.0.1:1", model="sim-model", lease_s=3600
    )
    return new_instance(reg, now=time.time(), default_lease_s=3600).model_copy(update={"url": url})


def test_bad_records_stop_neither_the_health_loop_nor_requests() -> None:
    with Deployment(prefill_policy="round_robin") as d:
        p1, _p2, _dec = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
        svc = d.app._holder["svc"]  # the embedded metaserver, written to on its own event loop
        loop = d.app.discovery._tasks[0].get_loop()
        for i, url in enumerate(BAD_URLS):
            asyncio.run_coroutine_threadsafe(
                svc.store.register(_bad_record(url, f"bad-{i}"), now=time.time()), loop
            ).result(5)
        time.sleep(3 * d.settings.health_interval_s)  # a few health rounds with the bad records listed
        assert not any(i["id"].startswith("bad") for i in d.health()["instances"])
        c = d.openai()
        for i in range(8):
            assert c.completions.create(model="sim-model", prompt=f"r{i}", max_tokens=1).choices
        p1.script(unhealthy=True)  # the health loop still runs: it ejects p1
        d.wait_available(p1.id, available=False)


async def _write(store_url: str, url: str) -> None:
    store = open_store(store_url, policy=policy_from(MetaSettings(store=store_url)))
    try:
        # The store writes the record, then re-reads it through the model, which refuses the URL now:
        # the record is in Redis all the same, as one from before the rule would be.
        with contextlib.suppress(ValidationError):
            await store.register(_bad_record(url), now=time.time())
    finally:
        await store.close()


def test_a_router_starts_with_a_bad_record_in_its_store() -> None:
    with RedisServer() as redis:
        asyncio.run(_write(redis.url, BAD_URLS[0]))
        with Deployment(store=redis.url) as d:  # before: "Application startup failed"
            assert d.health()["status"] == "unavailable"  # and it says why instead of crashing


def test_static_urls_follow_the_registration_rule() -> None:
    for bad in ("http://127.0.0.1:99999", "http://", "http://[::1", "http://user:pw@host:80/x?y="):
        with pytest.raises(ValueError, match="instance URL"):
            RouterSettings(prefill=[bad])
    with pytest.raises(ValueError, match="outside the allowed engine networks"):
        RouterSettings(decode=["http://10.1.2.3:8000"], allowed_engine_networks="192.168.0.0/16")
    assert RouterSettings(decode=["http://10.1.2.3:8000/"], allowed_engine_networks="10.0.0.0/8").decode == [
        "http://10.1.2.3:8000"
    ]

"""No forwarding loops (issue 9): a router that is its own instance, or another router's, must not
amplify traffic. Before, one request to a router registered as another router's instance (and that
router as the first one's) became 50 nested requests."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pdgate.models import InstanceRegistration
from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until


def _as_instance(url: str, instance_id: str) -> dict[str, object]:
    reg = InstanceRegistration(id=instance_id, role="both", url=url, model="sim-model", transport="sim")  # type: ignore[arg-type]
    return reg.model_dump(mode="json", exclude_none=True)


def _proxied(d: Deployment) -> float:
    """Proxied requests the router has answered: those it served, plus those refused as a loop."""
    text = httpx.get(d.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdgate_router_requests_total{")
        or (line.startswith("pdgate_router_errors_total{") and "pd_loop_detected" in line)
    )


def test_two_routers_listing_each_other_do_not_amplify_a_request() -> None:
    # No retries and a low in-flight cap bound the storm the loop makes without the hop header.
    # Health probes are kept out of the way: each router's /health is 503 (it has no real pair), which
    # would only hide the other router from it.
    bounds = {
        "prefill_retries": 0,
        "decode_retries": 0,
        "max_inflight": 20,
        "prefill_timeout_s": 10.0,
        "health_interval_s": 600.0,
    }
    with Deployment(**bounds) as a, Deployment(**bounds) as b:
        assert httpx.post(a.url + "/v1/instances", json=_as_instance(b.url, "router-b"), timeout=5).status_code == 200
        assert httpx.post(b.url + "/v1/instances", json=_as_instance(a.url, "router-a"), timeout=5).status_code == 200
        for d, other in ((a, "router-b"), (b, "router-a")):
            wait_until(lambda d=d, other=other: other in {i["id"] for i in d.health()["instances"]}, timeout=20)  # type: ignore[misc]
        before = _proxied(a) + _proxied(b)
        with pytest.raises(openai.APIStatusError):
            a.openai().completions.create(model="sim-model", prompt="loop?", max_tokens=1)
        # the client's request at A and one hop to B, answered 508 at once: nothing nested further
        wait_until(lambda: _proxied(a) + _proxied(b) - before >= 2, timeout=10, what="both answers counted")
        time.sleep(0.5)  # a loop would keep adding nested requests; none may follow
        assert _proxied(a) + _proxied(b) - before == 2


def test_a_request_that_was_already_forwarded_gets_508() -> None:
    with Deployment() as d:
        got = httpx.post(
            d.url + "/v1/completions",
            json={"model": "sim-model", "prompt": "x"},
            headers={"X-PDGate-Hop": "1"},  # what every router sends its engines
            timeout=5,
        )
        assert got.status_code == 508
        assert got.json()["error"]["code"] == "pd_loop_detected"


def test_the_router_refuses_to_register_its_own_address() -> None:
    with Deployment() as d:
        for url in (d.url, d.url.replace("127.0.0.1", "localhost") + "/"):
            got = httpx.post(d.url + "/v1/instances", json=_as_instance(url, "myself"), timeout=5)
            assert got.status_code == 422, got.text
            assert "url" in got.json()["detail"] and "own address" in got.json()["detail"]
        assert "myself" not in {i["id"] for i in d.health()["instances"]}


def test_a_router_ignores_its_own_address_in_an_external_registry() -> None:
    """With an external metaserver the router cannot refuse the registration; it leaves itself out."""
    with Deployment() as registry, Deployment(metaserver=registry.url) as router:
        own = _as_instance(router.url, "router-itself")
        assert httpx.post(registry.url + "/v1/instances", json=own, timeout=5).status_code == 200
        wait_until(
            lambda: "router-itself" in {i["id"] for i in registry.health()["instances"]}, timeout=10, what="listed"
        )
        time.sleep(3 * router.settings.refresh_interval_s)
        assert "router-itself" not in {i["id"] for i in router.health()["instances"]}

"""Ejection of failing instances: passive (circuit breaker) and active (GET /health probes)."""

from __future__ import annotations

import time

from tests.integration.router.conftest import Deployment


def test_breaker_ejects_a_prefill_that_keeps_failing() -> None:
    with Deployment(prefill_policy="round_robin", breaker_failures=2, breaker_open_s=300) as d:
        bad, good, dec = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
        d.wait_available(bad.id, good.id, dec.id)
        bad.script(fail_first=1000, fail_status=500)
        c = d.openai()
        for i in range(8):
            assert c.completions.create(model="sim-model", prompt=f"b{i}", max_tokens=1).choices
        assert bad.count("requests") == 2  # two failures opened its breaker; no traffic since
        assert good.count("prefill") == 8
        [row] = [i for i in d.health()["instances"] if i["id"] == bad.id]
        assert row["breaker"] == "open" and not row["available"]


def test_breaker_half_open_probe_closes_after_recovery() -> None:
    with Deployment(prefill_policy="round_robin", breaker_failures=1, breaker_open_s=0.3) as d:
        bad, good, dec = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
        d.wait_available(bad.id, good.id, dec.id)
        bad.script(fail_first=1, fail_status=500)
        c = d.openai()
        for i in range(2):
            c.completions.create(model="sim-model", prompt=f"h{i}", max_tokens=1)
        assert bad.count("scripted_failures") == 1
        d.wait_available(bad.id)  # after open_s the breaker lets a probe through (half-open)
        for i in range(4):
            c.completions.create(model="sim-model", prompt=f"k{i}", max_tokens=1)
        assert bad.count("prefill") >= 1
        [row] = [i for i in d.health()["instances"] if i["id"] == bad.id]
        assert row["breaker"] == "closed"


def test_active_health_checks_eject_and_readmit() -> None:
    with Deployment(prefill_policy="round_robin", health_interval_s=0.1) as d:
        sick, well, dec = d.add_many([("prefill", ()), ("prefill", ()), ("decode", ())])
        d.wait_available(sick.id, well.id, dec.id)
        sick.script(unhealthy=True)
        d.wait_available(sick.id, available=False)
        [row] = [i for i in d.health()["instances"] if i["id"] == sick.id]
        assert "failed its health check" in row["reason"] and "503" in row["reason"]
        c = d.openai()
        for i in range(4):
            c.completions.create(model="sim-model", prompt=f"a{i}", max_tokens=1)
        assert sick.count("requests") == 0 and well.count("prefill") == 4
        sick.script(unhealthy=False)
        d.wait_available(sick.id)
        for i in range(2):
            c.completions.create(model="sim-model", prompt=f"z{i}", max_tokens=1)
        assert sick.count("prefill") == 1


def test_a_slow_health_probe_takes_an_instance_out_only_after_several_in_a_row() -> None:
    """A busy engine answering /health late keeps serving; one that stays silent leaves rotation."""
    with Deployment(
        prefill_policy="round_robin", health_interval_s=0.2, health_timeout_s=0.1, health_timeouts_to_fail=100
    ) as d:
        slow, dec = d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(slow.id, dec.id)
        slow.script(health_delay=0.5)  # every probe times out from now on
        probes = slow.count("health_probes")
        deadline = time.monotonic() + 30
        while slow.count("health_probes") < probes + 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # several probes time out meanwhile; each one alone is not enough
        assert slow.count("health_probes") >= probes + 4
        for i in range(4):
            d.openai().completions.create(model="sim-model", prompt=f"s{i}", max_tokens=1)
        assert slow.count("prefill") == 4
        [row] = [i for i in d.health()["instances"] if i["id"] == slow.id]
        assert row["available"], row
    with Deployment(health_interval_s=0.1, health_timeout_s=0.1, health_timeouts_to_fail=3) as d:
        slow, dec = d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(slow.id, dec.id)
        slow.script(health_delay=0.5)
        d.wait_available(slow.id, available=False)
        [row] = [i for i in d.health()["instances"] if i["id"] == slow.id]
        assert "timed out" in row["reason"]
        slow.script(health_delay=0.0)
        d.wait_available(slow.id)


def test_router_health_is_503_until_a_pair_exists() -> None:
    with Deployment() as d:
        h = d.health()
        assert h["status"] == "unavailable" and h["reason"] == "no prefill or decode instance is registered"
        [p] = d.add_many([("prefill", ())])
        d.wait_available(p.id)
        h = d.health()
        assert h["status"] == "unavailable" and "no decode instance serves model sim-model" in h["reason"]
        assert d.openai().models.list().data == []
        [dec] = d.add_many([("decode", ())])
        d.wait_available(dec.id)
        assert d.health()["status"] == "ok"
        dec.script(unhealthy=True)
        d.wait_available(dec.id, available=False)
        h = d.health()
        assert h["status"] == "unavailable" and "failed its health check" in h["reason"]

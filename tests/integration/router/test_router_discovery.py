"""Registry-driven discovery: instances registered at runtime get traffic; drained, deregistered and
expired ones stop getting it. The router reads the registry in the background (never per request)."""

from __future__ import annotations

import signal

from tests.integration.router.conftest import HTTP, Deployment


def listed(d: Deployment) -> set[str]:
    return {i["id"] for i in HTTP.get(d.url + "/v1/instances").json()["instances"]}


def test_runtime_registration_drain_deregistration_and_expiry() -> None:
    with Deployment(prefill_policy="round_robin") as d:
        p1, dec = d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(p1.id, dec.id)
        c = d.openai()

        def send(n: int) -> None:
            for i in range(n):
                assert c.completions.create(model="sim-model", prompt=f"q{i}", max_tokens=1).choices

        [p2] = d.add_many([("prefill", ("--lease-s", "1"))])  # registered while the router runs
        d.wait_available(p2.id)
        send(4)
        assert p2.count("prefill") == 2 and p1.count("prefill") == 2

        assert HTTP.post(f"{d.url}/v1/instances/{p2.id}/drain").status_code == 200
        d.wait_available(p2.id, available=False)
        [row] = [i for i in d.health()["instances"] if i["id"] == p2.id]
        assert row["reason"] == "is draining"
        send(4)
        assert p2.count("prefill") == 2 and p1.count("prefill") == 6

        p2.stop()  # clean shutdown deregisters at once
        assert p2.id not in listed(d)
        d.wait_gone(p2.id)

        [p3] = d.add_many([("prefill", ("--lease-s", "1"))])
        d.wait_available(p3.id)
        p3.stop(signal.SIGKILL)  # no deregistration: its lease lapses
        d.wait_gone(p3.id)
        assert p3.id not in listed(d)
        send(2)
        assert p1.count("prefill") == 8

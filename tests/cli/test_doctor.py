"""`pdgate doctor` against real deployments set up wrong on purpose: each finding names what is wrong."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cli.conftest import TOKEN, metaserver, pdgate
from tests.integration.router.conftest import Deployment, Sim, start_sims
from tests.support.ports import free_port, wait_until
from tests.support.servers import UvicornThread


def _findings(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]]]:
    code, out, err = pdgate(capsys, "doctor", "--json", *argv)
    assert out, err
    return code, list(json.loads(out))


def _lines(found: list[dict[str, Any]], check: str, status: str) -> list[str]:
    return [f["message"] for f in found if f["check"] == check and f["status"] == status]


@pytest.fixture
def meta() -> Iterator[UvicornThread]:
    server = metaserver()
    yield server
    server.stop()


def _sims(meta_url: str, *specs: tuple[str, list[str]]) -> list[Sim]:
    return start_sims([(role, [*args, "--admin-token", TOKEN]) for role, args in specs], metaserver=meta_url)


def _registered(meta_url: str, n: int) -> None:
    import httpx

    wait_until(
        lambda: (
            len(httpx.get(meta_url + "/v1/instances", headers={"Authorization": f"Bearer {TOKEN}"}).json()["instances"])
            >= n
        ),
        what=f"{n} instances registered",
    )


def test_a_sound_stack_has_no_failure(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, found = _findings(capsys, "--router", stack.url, "--token", TOKEN)
    assert code == 0, [f for f in found if f["status"] == "fail"]
    assert _lines(found, "pool", "ok") == ["the router's pool and the registry agree (2 instances)"]
    assert _lines(found, "pairing", "ok") == ["every prefill pairs (1 prefill, 1 decode)"]
    assert len(_lines(found, "engines", "ok")) == 2
    assert all("contract 1" in m for m in _lines(found, "versions", "ok")[1:])
    code, out, _ = pdgate(capsys, "doctor", "--router", stack.url, "--token", TOKEN)
    assert "0 failed" in out


def test_an_instance_the_router_gives_no_work_is_named(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    decode = stack.by_role("decode")[0]
    decode.script(unhealthy=True)
    try:
        stack.wait_available(decode.id, available=False)
        _, found = _findings(capsys, "--router", stack.url, "--token", TOKEN)
        [msg] = _lines(found, "pool", "warn")
        assert msg.startswith(f"the router gives decode {decode.id} no work: ")
    finally:
        decode.script(unhealthy=False)
        stack.wait_available(decode.id)


def test_a_wrong_token_fails_and_names_the_setting(stack: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, found = _findings(capsys, "--router", stack.url, "--token", "not-the-token")
    assert code == 1
    [msg] = _lines(found, "metaserver", "fail")
    assert "refused the token" in msg and "--token" in msg


def test_a_router_holding_a_wrong_metaserver_token(meta: UvicornThread, capsys: pytest.CaptureFixture[str]) -> None:
    with Deployment(metaserver=meta.url, metaserver_token="wrong-one", admin_token=TOKEN) as router:
        wait_until(lambda: router.health()["registry_error"] is not None, what="the router's registry error")
        code, found = _findings(capsys, "--router", router.url, "--metaserver", meta.url, "--token", TOKEN)
    assert code == 1
    [msg] = _lines(found, "router", "fail")
    assert "the router cannot read its registry" in msg


def test_a_router_whose_admin_token_differs(meta: UvicornThread, capsys: pytest.CaptureFixture[str]) -> None:
    """The metaserver takes the token, the router does not: its /health hides the instances' URLs."""
    sims = _sims(meta.url, ("prefill", []), ("decode", []))
    try:
        with Deployment(metaserver=meta.url, metaserver_token=TOKEN, admin_token="router-own-token") as router:
            wait_until(lambda: len(router.health()["instances"]) == 2, what="the router's pool")
            code, found = _findings(capsys, "--router", router.url, "--metaserver", meta.url, "--token", TOKEN)
        assert code == 1
        assert _lines(found, "router", "fail") == [
            "the router did not take --token as its admin token (its /health hid the instances' URLs)"
        ]
    finally:
        for sim in sims:
            sim.stop()


def test_clock_skew_against_a_real_redis(stack: Deployment, redis_url: str) -> None:
    """This host's clock against Redis's TIME; a clock 5 s ahead fails (the check reads `Facts.clock`)."""
    from pdgate.cli.checks import clock_skew
    from pdgate.cli.client import Admin
    from pdgate.cli.doctor import Facts
    from pdgate.cli.settings import CliSettings

    with Admin(CliSettings(router=stack.url, token=TOKEN)) as admin:
        [ok] = clock_skew(Facts(admin=admin, redis=redis_url))
        [ahead] = clock_skew(Facts(admin=admin, redis=redis_url, clock=lambda: time.time() + 5))
        [down] = clock_skew(Facts(admin=admin, redis=f"redis://127.0.0.1:{free_port()}/0"))
    assert ok.status == "ok"
    assert ahead.status == "fail" and "NTP" in ahead.fix
    said = re.search(r"clock is ([-+][0-9.]+) s off", ahead.message)
    assert said is not None and abs(float(said[1]) + 5) < 0.25, ahead.message  # within a loaded round trip
    assert down.status == "fail" and "cannot be read" in down.message


def test_an_engine_left_out_by_allowed_networks_is_named(
    meta: UvicornThread, capsys: pytest.CaptureFixture[str]
) -> None:
    sims = _sims(meta.url, ("prefill", []), ("decode", []))
    try:
        with Deployment(metaserver=meta.url, metaserver_token=TOKEN, admin_token=TOKEN,
                        allowed_engine_networks="10.0.0.0/8") as router:  # fmt: skip
            _registered(meta.url, 2)
            argv = ("--router", router.url, "--metaserver", meta.url, "--token", TOKEN)
            code, found = _findings(capsys, *argv)
            assert code == 1
            fails = _lines(found, "pool", "fail")
            assert sorted(s.id for s in sims) == sorted(m.split()[1] for m in fails)
            assert all("registered but not in the router's pool" in m for m in fails)
            _, found = _findings(capsys, *argv, "--allowed-engine-networks", "10.0.0.0/8")
            assert all("outside --allowed-engine-networks" in m for m in _lines(found, "pool", "fail"))
    finally:
        for sim in sims:
            sim.stop()


def test_an_engine_reporting_to_another_ledger_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """The router routes to engines (static URLs) whose connectors report to another metaserver: the
    router's handoffs for them stay PENDING. Doctor, pointed at the router's metaserver, names them."""
    ours, theirs = metaserver(), metaserver()
    sims = _sims(theirs.url, ("prefill", []), ("decode", []))
    try:
        p, d = sims
        with Deployment(metaserver=ours.url, metaserver_token=TOKEN, admin_token=TOKEN,
                        prefill=[p.url], decode=[d.url]) as router:  # fmt: skip
            code, found = _findings(capsys, "--router", router.url, "--metaserver", ours.url, "--token", TOKEN)
        assert code == 1
        fails = _lines(found, "pool", "fail")
        assert {p.url, d.url} == {u for u in (p.url, d.url) for m in fails if u in m}
        assert all("reports to another ledger" in m for m in fails)
    finally:
        for sim in sims:
            sim.stop()
        ours.stop()
        theirs.stop()


def _host_address() -> str:
    """This host's non-loopback address (the route towards a documentation address; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.200", 9))
        return str(s.getsockname()[0])


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_a_metaserver_bound_to_loopback_with_engines_elsewhere(bind: str, capsys: pytest.CaptureFixture[str]) -> None:
    here = _host_address()
    server = metaserver(host=bind)
    url = f"http://127.0.0.1:{server.port}"
    port = free_port()
    # An engine on another host (a documentation address: never one of this host's), reached through
    # this host's routable address.
    sim = Sim("decode", "--advertise-url", f"http://192.0.2.77:{port}", "--admin-token", TOKEN, metaserver=url,
              name="far-decode")  # fmt: skip
    try:
        _registered(url, 1)
        code, found = _findings(capsys, "--metaserver", url, "--token", TOKEN, "--timeout-s", "1")
        assert code == 1  # the engine cannot be reached either way
        if bind == "127.0.0.1":
            [msg] = _lines(found, "bind", "fail")
            assert f"not on {here}:{server.port}" in msg and "bound to loopback" in msg
        else:
            assert _lines(found, "bind", "ok") == [f"the metaserver on port {server.port} also answers on {here}"]
        [unreached] = _lines(found, "engines", "fail")
        assert "far-decode" in unreached and "cannot be reached from this host" in unreached
    finally:
        sim.stop()
        server.stop()


def test_engines_on_this_host_reach_a_loopback_metaserver(capsys: pytest.CaptureFixture[str]) -> None:
    """`vllm serve` without --host registers this host's routable address: a loopback-bound metaserver
    on the same host serves it, and doctor must not say otherwise (the walkthrough's false failure)."""
    here = _host_address()
    server = metaserver(host="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}"
    sim = Sim("decode", "--advertise-url", f"http://{here}:{free_port()}", "--admin-token", TOKEN, metaserver=url,
              name="near-decode")  # fmt: skip
    try:
        _registered(url, 1)
        _, found = _findings(capsys, "--metaserver", url, "--token", TOKEN, "--timeout-s", "1")
        assert _lines(found, "bind", "fail") == []
        assert _lines(found, "bind", "skip") == ["no loopback-bound service with engines on other hosts"]
    finally:
        sim.stop()
        server.stop()


def test_engines_that_cannot_pair_are_named(meta: UvicornThread, capsys: pytest.CaptureFixture[str]) -> None:
    sims = _sims(meta.url, ("prefill", ["--block-size", "16"]), ("decode", ["--block-size", "32"]))
    try:
        _registered(meta.url, 2)
        code, found = _findings(capsys, "--metaserver", meta.url, "--token", TOKEN)
        assert code == 1
        [msg] = _lines(found, "pairing", "fail")
        assert sims[0].id in msg and sims[1].id in msg and "block_size 32" in msg
    finally:
        for sim in sims:
            sim.stop()


def test_transport_and_side_channel_ports(meta: UvicornThread, capsys: pytest.CaptureFixture[str]) -> None:
    sims = _sims(meta.url, ("prefill", ["--transport", "nixl"]))
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        _registered(meta.url, 1)
        _, found = _findings(
            capsys, "--metaserver", meta.url, "--token", TOKEN, "--side-channel-ports", f"{port}-{port}"
        )
        [line] = [f for f in found if f["check"] == "transport"]
        assert "nixl._api" in line["message"]
        assert line["status"] == ("ok" if importlib.util.find_spec("nixl") else "warn")
        [ports] = [f for f in found if f["check"] == "ports"]
        assert ports["status"] == "warn" and str(port) in ports["message"]
        busy.close()
        _, found = _findings(
            capsys, "--metaserver", meta.url, "--token", TOKEN, "--side-channel-ports", f"{port}-{port}"
        )
        assert [f["status"] for f in found if f["check"] == "ports"] == ["ok"]
    finally:
        busy.close()
        for sim in sims:
            sim.stop()

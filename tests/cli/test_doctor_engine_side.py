"""`pdgate doctor` asks the engines themselves: the role each registered against the kv_role its vLLM runs
with (vLLM's dev-mode /server_info), and its connector's token against the router's and the metaserver's
(the connector's counters on /metrics). Engines over real sockets, registered at a real metaserver; what
they answer is what vLLM and PDGateConnector answer, trimmed to what the checks read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cli.conftest import TOKEN, metaserver, pdgate
from tests.integration.router.conftest import Deployment
from tests.support.servers import UvicornThread


def _connector_metrics(untrusted: int = 0, ready_failed: int = 0) -> str:
    """PDGateConnector's counters as vLLM's /metrics shows them (per engine label), a few of them."""
    lines = []
    for name, value in (("registrations", 1), ("claims_untrusted", untrusted), ("ready_failed", ready_failed)):
        lines += [
            f"# HELP pdgate_connector_{name}_total {name}",
            f"# TYPE pdgate_connector_{name}_total counter",
            f'pdgate_connector_{name}_total{{engine="0",model_name="m"}} {float(value)}',
        ]
    return "\n".join(lines) + "\n"


def engine_app(kv_role: str | None, metrics: str = "") -> Any:
    """An engine answering /health, /metrics and (when `kv_role` is given, as with VLLM_SERVER_DEV_MODE=1)
    vLLM's /server_info?config_format=json."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        status, body = 200, b"{}"
        if scope["path"] == "/metrics":
            body = metrics.encode()
        elif scope["path"] == "/server_info":
            if kv_role is None:
                status, body = 404, b'{"detail":"Not Found"}'
            else:
                config = {"kv_transfer_config": {"kv_connector": "PDGateConnector", "kv_role": kv_role}}
                body = json.dumps({"vllm_config": config}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.fixture
def meta() -> Iterator[UvicornThread]:
    server = metaserver()
    yield server
    server.stop()


def _register(meta_url: str, engine_url: str, name: str, role: str) -> None:
    body = {"id": name, "role": role, "url": engine_url, "model": "m", "transport": "sim"}
    resp = httpx.post(meta_url + "/v1/instances", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text


def _doctor(capsys: pytest.CaptureFixture[str], meta_url: str, check: str) -> tuple[int, list[dict[str, Any]]]:
    code, out, _ = pdgate(capsys, "doctor", "--metaserver", meta_url, "--token", TOKEN, "--json")
    return code, [f for f in json.loads(out) if f["check"] == check]


def test_a_role_other_than_the_engines_kv_role_is_named(
    meta: UvicornThread, capsys: pytest.CaptureFixture[str]
) -> None:
    with UvicornThread(engine_app("kv_consumer")) as consumer, UvicornThread(engine_app("kv_both")) as both:
        _register(meta.url, consumer.url, "wrong-role", "prefill")
        _register(meta.url, both.url, "right-role", "both")
        code, found = _doctor(capsys, meta.url, "role")
    assert code == 1
    [bad] = [f for f in found if f["status"] == "fail"]
    assert bad["message"] == "wrong-role registered as prefill, but its vLLM runs with kv_role kv_consumer (decode)"
    assert [f["message"] for f in found if f["status"] == "ok"] == ["right-role: role both, as its kv_role kv_both"]


def test_a_router_claim_under_another_token_and_refused_readies_are_named(
    meta: UvicornThread, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        UvicornThread(engine_app(None, _connector_metrics(untrusted=3))) as decode,
        UvicornThread(engine_app(None, _connector_metrics(ready_failed=2))) as prefill,
        UvicornThread(engine_app(None, _connector_metrics())) as sound,
    ):
        _register(meta.url, decode.url, "d-other-token", "decode")
        _register(meta.url, prefill.url, "p-refused", "prefill")
        _register(meta.url, sound.url, "d-sound", "decode")
        code, found = _doctor(capsys, meta.url, "tokens")
    assert code == 1
    by_status = {f["status"]: f["message"] for f in found}
    assert by_status["fail"].startswith(
        "decode d-other-token: 3 router claims were not sealed with its connector token"
    )
    assert by_status["warn"].startswith("prefill p-refused: the ledger refused 2 READY records")
    assert by_status["ok"] == "decode d-sound: registered under its connector token, no claim or READY refused"


def test_engines_that_show_neither_are_skipped_saying_what_is_unseen(
    stack: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = pdgate(capsys, "doctor", "--router", stack.url, "--token", TOKEN, "--json")
    found = {f["check"]: f for f in json.loads(out) if f["check"] in ("role", "tokens")}
    assert found["role"]["status"] == "skip" and "VLLM_SERVER_DEV_MODE=1" in found["role"]["message"]
    assert found["tokens"]["status"] == "skip" and "only missing from the registry" in found["tokens"]["message"]

"""Who may write to the router's embedded metaserver (issue 9, "Writes need a credential").

Each test reproduces an attack that worked against the router: an anonymous registration that then
received every client's prompts and keys.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pdgate.router.app import create_app
from pdgate.router.settings import RouterSettings

from tests.security.router_support import non_loopback_ipv4
from tests.support.ports import free_port
from tests.support.servers import UvicornThread

EVIL = {"id": "evil", "role": "both", "url": "http://203.0.113.9:8000", "model": "sim-model"}


def _router(host: str = "127.0.0.1", **settings: Any) -> UvicornThread:
    port = free_port(host)
    s = RouterSettings(host=host, port=port, refresh_interval_s=0.1, log_level="warning", **settings)
    return UvicornThread(create_app(s), host=host, port=port)


@pytest.fixture
def lan_ip() -> str:
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    return ip


@pytest.fixture(autouse=True)
def _no_admin_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("PDGATE_ADMIN_TOKEN", "PDGATE_ADMIN_TOKEN_FILE", "PDGATE_ROUTER_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield


def test_without_a_token_a_remote_peer_cannot_register(lan_ip: str) -> None:
    with _router(lan_ip) as r:
        got = httpx.post(r.url + "/v1/instances", json=EVIL, timeout=5)
        assert got.status_code == 403, got.text
        assert got.headers["content-type"].startswith("application/problem+json")
        assert "protected mode" in got.json()["detail"]


def test_without_a_token_a_remote_peer_cannot_touch_handoffs(lan_ip: str) -> None:
    with _router(lan_ip) as r:
        created = httpx.post(r.url + "/v1/handoffs", json={"prefill_instance_id": "p", "transfer_id": "t-1"}, timeout=5)
        assert created.status_code == 403
        assert httpx.post(r.url + "/v1/handoffs/t-1/abort", json={"reason": "x"}, timeout=5).status_code == 403
        assert httpx.delete(r.url + "/v1/instances/p", timeout=5).status_code == 403


def test_the_client_api_key_does_not_open_the_metaserver_routes(lan_ip: str) -> None:
    with _router(lan_ip, api_key=["client-key"]) as r:
        got = httpx.post(r.url + "/v1/instances", json=EVIL, headers={"Authorization": "Bearer client-key"}, timeout=5)
        assert got.status_code == 403, got.text


def test_with_a_token_even_loopback_needs_it() -> None:
    with _router(admin_token="s3cret-admin") as r:
        assert httpx.post(r.url + "/v1/instances", json=EVIL, timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer client-key"}
        assert httpx.post(r.url + "/v1/instances", json=EVIL, headers=wrong, timeout=5).status_code == 401
        ok = httpx.post(r.url + "/v1/instances", json=EVIL, headers={"Authorization": "Bearer s3cret-admin"}, timeout=5)
        assert ok.status_code == 200, ok.text


def test_pdgate_admin_token_in_the_environment_protects_the_embedded_metaserver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDGATE_ADMIN_TOKEN", "from-the-env")
    with _router() as r:
        assert httpx.post(r.url + "/v1/instances", json=EVIL, timeout=5).status_code == 401
        auth = {"Authorization": "Bearer from-the-env"}
        assert httpx.post(r.url + "/v1/instances", json=EVIL, headers=auth, timeout=5).status_code == 200


def test_the_admin_token_file_is_read_and_stays_off_the_command_line(tmp_path: Any) -> None:
    secret = tmp_path / "admin-token"
    secret.write_text("file-token\n")
    secret.chmod(0o600)
    with _router(admin_token_file=str(secret)) as r:
        assert httpx.post(r.url + "/v1/instances", json=EVIL, timeout=5).status_code == 401
        auth = {"Authorization": "Bearer file-token"}
        assert httpx.post(r.url + "/v1/instances", json=EVIL, headers=auth, timeout=5).status_code == 200
    secret.chmod(0o644)
    with pytest.raises(ValueError, match="other users"):
        RouterSettings(admin_token_file=str(secret))


def test_start_up_says_protected_mode(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdgate.router"), _router():
        pass
    assert any("protected mode" in rec.getMessage() for rec in caplog.records)


def test_loopback_peers_may_still_register_without_a_token() -> None:
    """Protected mode keeps the single-host quick start working: engines on the same host register."""
    with _router() as r:
        assert httpx.post(r.url + "/v1/instances", json=EVIL, timeout=5).status_code == 200

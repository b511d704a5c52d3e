"""Point: who may do what on the metaserver (admin token, protected mode, secret files, anonymous ids).

Each test plays an anonymous client trying what an unguarded metaserver allows: register an instance
(and so receive every client's prompts), read another request's KV location, or squat transfer ids.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pdgate.metaserver.settings import MetaSettings, parse_cli

from pdgate.auth import SecretFileError, credential_matches, matches_any, read_secret_file, read_secret_lines
from tests.security.conftest import AUTH, TOKEN, Serve, registration
from tests.support.meta import uid


async def test_protected_mode_refuses_writes_from_other_hosts(serve: Serve, outside_ip: str) -> None:
    """No token configured: a peer that is not on loopback cannot register, drain or create handoffs."""
    server = serve(host="0.0.0.0")
    outside = f"http://{outside_ip}:{server.port}"
    async with httpx.AsyncClient(base_url=outside) as http:
        resp = await http.post("/v1/instances", json=registration("evil", url="http://192.0.2.66:8000"))
        assert resp.status_code == 403, resp.text
        assert resp.headers["content-type"] == "application/problem+json"
        body = resp.json()
        assert body["code"] == "forbidden" and "PDGATE_ADMIN_TOKEN" in body["detail"]
        assert (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).status_code == 403
        assert (await http.get("/v1/instances")).status_code == 403  # instance URLs stay private too
        assert (await http.get("/metrics")).status_code == 200  # ops routes stay open
        assert (await http.get("/openapi.json")).status_code == 200
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as local:
        assert (await local.post("/v1/instances", json=registration())).status_code == 200
        assert [i["id"] for i in (await local.get("/v1/instances")).json()["instances"]] == ["p0"]


async def test_token_guards_writes_and_address_reads(serve: Serve) -> None:
    """With a token, anonymous writes get 401 and anonymous reads of records with addresses get 401."""
    url = serve(admin_token=TOKEN).url
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/instances", json=registration(), headers=AUTH)).status_code == 200
        created = await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"}, headers=AUTH)
        tid = created.json()["transfer_id"]
        ready = {"block_ids": [[1, 2]], "num_tokens": 20, "host": "10.0.0.5", "remote_request_id": "secret-req"}
        assert (await http.put(f"/v1/handoffs/{tid}/ready", json=ready, headers=AUTH)).status_code == 200

        for method, path in [
            ("GET", f"/v1/handoffs/{tid}"),
            ("GET", "/v1/instances"),
            ("GET", "/v1/instances/p0"),
            ("GET", "/v1/instances/p0/handoff-events"),
            ("POST", f"/v1/handoffs/{tid}/claim"),
            ("POST", "/v1/instances/p0/drain"),
            ("DELETE", "/v1/instances/p0"),
        ]:
            resp = await http.request(method, path, json={"decode_instance_id": "d0"} if "claim" in path else None)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
            assert "10.0.0.5" not in resp.text and "secret-req" not in resp.text
        wrong = {"Authorization": f"Bearer {TOKEN[:-1]}x"}
        assert (await http.get(f"/v1/handoffs/{tid}", headers=wrong)).status_code == 401
        assert (await http.get(f"/v1/handoffs/{tid}", headers=AUTH)).json()["location"]["host"] == "10.0.0.5"
        for open_path in ("/health", "/metrics", "/docs", "/openapi.json"):
            assert (await http.get(open_path)).status_code == 200, open_path


async def test_anonymous_client_cannot_squat_transfer_ids(serve: Serve, outside_ip: str) -> None:
    """An anonymous client cannot create handoffs in advance (token set, or protected mode from afar);
    the ids the metaserver mints itself carry 128 random bits."""
    with_token = serve(admin_token=TOKEN).url
    protected = serve(host="0.0.0.0")
    guesses = [uid("squat") for _ in range(5)]
    for base in (with_token, f"http://{outside_ip}:{protected.port}"):
        async with httpx.AsyncClient(base_url=base) as http:
            for tid in guesses:
                resp = await http.post("/v1/handoffs", json={"prefill_instance_id": "p0", "transfer_id": tid})
                assert resp.status_code in (401, 403), resp.text
    async with httpx.AsyncClient(base_url=with_token, headers=AUTH) as http:
        for tid in guesses:  # none of the guessed ids exists: real requests can use them
            assert (
                await http.post("/v1/handoffs", json={"prefill_instance_id": "p0", "transfer_id": tid})
            ).status_code == 201
        minted = {
            (await http.post("/v1/handoffs", json={"prefill_instance_id": "p0"})).json()["transfer_id"]
            for _ in range(3)
        }
        assert len(minted) == 3 and all(len(t) >= 32 for t in minted)


def test_one_constant_time_compare() -> None:
    assert credential_matches(TOKEN, TOKEN) and not credential_matches(TOKEN + "x", TOKEN)
    assert not credential_matches(None, TOKEN) and not credential_matches("", TOKEN)
    assert matches_any("k2", ["k1", "k2", "k3"]) and not matches_any("k", ["k1", "k2"])
    assert credential_matches("ключ", "ключ")  # non-ASCII keys compare as UTF-8, without TypeError


def test_loopback_and_bearer_parsing() -> None:
    from pdgate.auth import bearer, is_loopback

    for peer in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", None):
        assert is_loopback(peer), peer
    for peer in ("192.0.2.2", "10.0.0.1", "fd00::2", "::ffff:10.0.0.1", "localhost", "0.0.0.0"):
        assert not is_loopback(peer), peer
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None and bearer("Bearer") is None and bearer(None) is None


def test_admin_token_from_a_file_never_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "admin-token"
    secret.write_text(TOKEN + "\n")
    secret.chmod(0o600)
    assert parse_cli(["--admin-token-file", str(secret)]).admin_token == TOKEN
    monkeypatch.setenv("PDGATE_ADMIN_TOKEN_FILE", str(secret))
    assert MetaSettings().admin_token == TOKEN
    monkeypatch.delenv("PDGATE_ADMIN_TOKEN_FILE")
    monkeypatch.setenv("PDGATE_ADMIN_TOKEN", TOKEN)
    assert MetaSettings().admin_token == TOKEN and MetaSettings().protected_mode is False
    monkeypatch.delenv("PDGATE_ADMIN_TOKEN")
    assert MetaSettings().protected_mode is True
    secret.chmod(0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        read_secret_file(secret)
    with pytest.raises(ValueError, match="admin_token"):
        parse_cli(["--admin-token-file", str(tmp_path / "missing")])
    keys = tmp_path / "client-keys"
    keys.write_text("k1\n\n  k2 \n")
    keys.chmod(0o600)
    assert read_secret_lines(keys) == ["k1", "k2"]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ValueError, match="empty"):
        parse_cli(["--admin-token-file", str(empty)])


def test_start_up_log_says_protected_mode(tmp_path: Path) -> None:
    """`pdgate-metaserver` without a token says at start-up that only loopback peers may use /v1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_")}
    code = (
        "import logging, sys\n"
        "from pdgate.metaserver.app import access_summary\n"
        "from pdgate.metaserver.settings import parse_cli\n"
        "print(access_summary(parse_cli(sys.argv[1:])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "protected mode" in out and "loopback" in out and "PDGATE_ADMIN_TOKEN" in out


async def test_protected_mode_is_logged_by_the_app(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdgate.metaserver"):
        serve()
    assert any("protected mode" in r.getMessage() for r in caplog.records)

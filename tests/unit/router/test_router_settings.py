"""settings.py: env vars, flags (a flag wins), list fields, --help covers every field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdgate.router.settings import RouterSettings, build_parser, parse_cli
from pydantic import ValidationError


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_ROUTER_PORT", "9000")
    monkeypatch.setenv("PDGATE_ROUTER_PREFILL", "http://a:1, http://b:2/")
    monkeypatch.setenv("PDGATE_ROUTER_DECODE_POLICY", "round_robin")
    s = parse_cli(["--port", "9100", "--decode", "http://d:1", "--decode", "http://d:2", "--api-key", "k1"])
    assert s.port == 9100  # flag wins
    assert s.prefill == ["http://a:1", "http://b:2"]
    assert s.decode == ["http://d:1", "http://d:2"]
    assert s.decode_policy == "round_robin" and s.api_key == ["k1"]
    assert s.embedded and s.store == "memory://"


def test_help_lists_every_field_with_its_env_var() -> None:
    text = build_parser().format_help()
    for name in RouterSettings.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert "PDGATE_ROUTER_" + name.upper() in text.replace("\n", "").replace(" ", "")


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "ftp://x"],
        ["--metaserver", "redis://x"],
        ["--prefill-policy", "random"],
        ["--retry-backoff-s", "2", "--retry-backoff-max-s", "1"],
    ],
)
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises((ValidationError, SystemExit)):
        parse_cli(argv)


def test_engine_metaserver_url() -> None:
    assert RouterSettings(host="10.0.0.5", port=8000).engine_metaserver_url() == "http://10.0.0.5:8000"
    assert RouterSettings(host="0.0.0.0").engine_metaserver_url() is None
    assert RouterSettings(host="0.0.0.0", advertise_metaserver="http://r:1/").engine_metaserver_url() == "http://r:1"
    assert RouterSettings(metaserver="http://m:2").engine_metaserver_url() == "http://m:2"


def test_empty_list_env_values_mean_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_ROUTER_API_KEY", "")
    monkeypatch.setenv("PDGATE_ROUTER_DECODE", "")
    s = parse_cli([])
    assert s.api_key == [] and s.decode == []


def _secret(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_secrets_come_from_files(tmp_path: Path) -> None:
    s = parse_cli(
        [
            "--admin-token-file", _secret(tmp_path, "admin", "adm\n"),
            "--upstream-api-key-file", _secret(tmp_path, "up", "  engine-key  \n"),
            "--metaserver-token-file", _secret(tmp_path, "meta", "mt"),
            "--api-key-file", _secret(tmp_path, "keys", "k2\n\nk3\n"),
            "--api-key", "k1",
        ]
    )  # fmt: skip
    assert (s.admin_token, s.upstream_api_key, s.metaserver_token) == ("adm", "engine-key", "mt")
    assert s.api_key == ["k1", "k2", "k3"]


@pytest.mark.parametrize(
    ("field", "problem"),
    [("admin_token_file", "other users"), ("api_key_file", "other users"), ("upstream_api_key_file", "empty")],
)
def test_unusable_secret_files_are_refused(tmp_path: Path, field: str, problem: str) -> None:
    path = _secret(tmp_path, "s", "" if problem == "empty" else "x", 0o600 if problem == "empty" else 0o644)
    with pytest.raises(ValidationError, match=problem):
        RouterSettings(**{field: path})
    with pytest.raises(ValidationError, match="cannot read"):
        RouterSettings(**{field: str(tmp_path / "missing")})


def test_a_secret_and_its_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="both set"):
        RouterSettings(admin_token="a", admin_token_file=_secret(tmp_path, "a", "b"))


def test_client_credentials_are_not_forwarded_unless_asked() -> None:
    assert RouterSettings().forward_client_auth is False
    assert parse_cli(["--forward-client-auth"]).forward_client_auth is True


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:99999", "http://", "http://[::1", "http://user:pw@host:80/x?y=", "http://h:80/v1"]
)
def test_static_urls_follow_the_engine_url_rule(url: str) -> None:
    with pytest.raises(ValidationError, match="instance URL"):
        RouterSettings(prefill=[url])


def test_allowed_engine_networks_bound_static_urls() -> None:
    assert RouterSettings(decode=["http://10.0.0.7:80"], allowed_engine_networks="10.0.0.0/8").decode
    with pytest.raises(ValidationError, match="outside the allowed engine networks"):
        RouterSettings(decode=["http://172.16.0.7:80"], allowed_engine_networks="10.0.0.0/8")
    with pytest.raises(ValidationError, match="is a name"):
        RouterSettings(decode=["http://engine:80"], allowed_engine_networks="10.0.0.0/8")
    with pytest.raises(ValidationError, match="CIDR"):
        RouterSettings(allowed_engine_networks="10.0.0.0/33")


def test_secret_values_on_the_command_line_are_named_for_a_warning() -> None:
    from pdgate.router.__main__ import _secrets_on_argv

    argv = ["--port", "1", "--api-key", "k", "--admin-token=x", "--api-key-file", "f", "--upstream-api-key-file", "g"]
    assert _secrets_on_argv(argv) == ["--admin-token", "--api-key"]

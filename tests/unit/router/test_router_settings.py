"""settings.py: env vars, flags (a flag wins), list fields, --help covers every field."""

from __future__ import annotations

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

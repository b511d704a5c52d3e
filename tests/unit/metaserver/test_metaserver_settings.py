"""Settings: env vars, flags (a flag wins), and --help documenting every field."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdgate.metaserver.settings import MetaSettings, build_parser, parse_cli


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_PORT", "9001")
    monkeypatch.setenv("PDGATE_STORE", "redis://r:6379/0")
    monkeypatch.setenv("PDGATE_ADMIN_TOKEN", "env-token")
    s = parse_cli(["--port", "9002", "--ready-lease-s", "2.5", "--auth-reads"])
    assert (s.port, s.store, s.admin_token, s.ready_lease_s, s.auth_reads) == (
        9002,
        "redis://r:6379/0",
        "env-token",
        2.5,
        True,
    )
    assert s.host == "127.0.0.1" and s.instance_lease_s == 10 and s.pending_lease_s == 60


def test_defaults() -> None:
    s = MetaSettings()
    assert (s.store, s.instance_lease_s, s.ready_lease_s, s.claim_lease_s, s.pending_lease_s) == (
        "memory://",
        10.0,
        30.0,
        10.0,
        60.0,
    )


def test_bad_values_are_refused() -> None:
    with pytest.raises(Exception, match="ready_lease_s"):
        parse_cli(["--ready-lease-s", "-1"])


def test_help_documents_every_field() -> None:
    text = build_parser().format_help()
    for name in MetaSettings.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert "PDGATE_" + name.upper() in text


def test_console_entry_point_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdgate.metaserver", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in ("--host", "--port", "--store", "--admin-token", "PDGATE_STORE"):
        assert flag in out.stdout

"""Where `pdgate` reads its target and token: flag over PDGATE_CLI_* over the config file over defaults."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pdgate.cli_config import write_cli_config
from tests.cli.conftest import TOKEN, pdgate
from tests.integration.router.conftest import Deployment


def _config(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = pdgate(capsys, "config", "--json", *argv)
    assert code == 0, err
    return dict(json.loads(out))


def test_the_local_stacks_file_is_read_and_env_and_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_cli_config(tmp_path / ".pdgate" / "cli.toml", router="http://10.1.1.1:8000", token="t0k")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds a token
    seen = _config(capsys)
    assert seen["router"] == "http://10.1.1.1:8000" and seen["token"] == "(set)"
    assert seen["config"] == str(path)
    monkeypatch.setenv("PDGATE_CLI_ROUTER", "http://10.2.2.2:8000")
    assert _config(capsys)["router"] == "http://10.2.2.2:8000"
    assert _config(capsys, "--router", "http://10.3.3.3:8000")["router"] == "http://10.3.3.3:8000"


def test_the_users_file_and_a_named_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cli_config(tmp_path / ".config" / "pdgate" / "config.toml", router="http://user:1")
    assert _config(capsys)["router"] == "http://user:1"
    other = write_cli_config(tmp_path / "other.toml", router="http://other:2", metaserver="http://meta:3")
    seen = _config(capsys, "--config", str(other))
    assert (seen["router"], seen["metaserver"]) == ("http://other:2", "http://meta:3")
    monkeypatch.setenv("PDGATE_CLI_CONFIG", str(tmp_path / "missing.toml"))
    code, _, err = pdgate(capsys, "config")
    assert code == 2 and "missing.toml does not exist" in err


def test_unknown_keys_are_refused_when_written() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        write_cli_config(Path("/nonexistent/x.toml"), routr="http://x")


def test_a_command_runs_from_the_file_alone(
    tmp_path: Path, stack: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cli_config(tmp_path / ".pdgate" / "cli.toml", router=stack.url, token=TOKEN)
    code, out, err = pdgate(capsys, "instances", "--json")
    assert code == 0, err
    assert {r["id"] for r in json.loads(out)} == {s.id for s in stack.sims}


def test_no_target_names_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = pdgate(capsys, "instances")
    assert code == 1 and "--router" in err and "PDGATE_CLI_" in err

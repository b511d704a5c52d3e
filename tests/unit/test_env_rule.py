"""One environment-variable rule for every pdgate command: `--some-flag` of `pdgate-<command>` is
`PDGATE_<COMMAND>_SOME_FLAG` (a flag wins), and the metaserver's older `PDGATE_<FLAG>` names still work."""

from __future__ import annotations

import pytest
from pdgate.deploy.local.launcher import UpSettings
from pdgate.deploy.local.launcher import build_parser as local_parser
from pdgate.deploy.local.launcher import parse_cli as local_cli
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.settings import parse_cli as meta_cli
from pdgate.router.settings import RouterSettings
from pdgate.sim.settings import SimSettings
from pydantic import ValidationError


def test_port_of_every_command_follows_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix, port in (("ROUTER", 8101), ("METASERVER", 8102), ("LOCAL", 8103), ("SIM", 8104)):
        monkeypatch.setenv(f"PDGATE_{prefix}_PORT", str(port))
    assert RouterSettings().port == 8101
    assert MetaSettings().port == 8102
    assert local_cli(["up"]).port == 8103
    assert SimSettings().port == 8104


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_METASERVER_PORT", "8102")
    monkeypatch.setenv("PDGATE_LOCAL_PORT", "8103")
    assert meta_cli(["--port", "9001"]).port == 9001
    assert local_cli(["up", "--port", "9002"]).port == 9002


def test_the_metaservers_older_names_still_work_and_the_new_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_STORE", "redis://old:6379/0")
    monkeypatch.setenv("PDGATE_PORT", "7001")
    assert (MetaSettings().store, MetaSettings().port) == ("redis://old:6379/0", 7001)
    monkeypatch.setenv("PDGATE_METASERVER_PORT", "7002")
    assert MetaSettings().port == 7002


def test_local_switches_read_the_environment_and_help_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_LOCAL_EXIT_AFTER_DEMO", "1")
    monkeypatch.setenv("PDGATE_LOCAL_MODEL_DIR", "/models/qwen")
    args = local_cli(["up"])
    assert isinstance(args, UpSettings)
    assert args.exit_after_demo is True and str(args.model_dir) == "/models/qwen"
    up_help = local_parser()._subparsers._group_actions[0].choices["up"].format_help()  # type: ignore[union-attr]
    assert "PDGATE_LOCAL_PREFILL" in up_help and "random weights" in up_help


def test_every_command_documents_each_flag_with_its_env_and_default() -> None:
    """One parser (pdgate.settings) for all of them: each flag's help names its env var, and its default."""
    from pdgate.metaserver.settings import build_parser as meta_parser
    from pdgate.router.settings import build_parser as router_parser

    meta_help = " ".join(meta_parser().format_help().split())
    assert "PDGATE_METASERVER_STORE, or PDGATE_STORE" in meta_help and "(default: 8300)" in meta_help
    assert "PDGATE_ROUTER_PORT" in router_parser().format_help()
    up = local_parser()._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    up_help = " ".join(up.format_help().split())
    assert "[env PDGATE_LOCAL_PORT] (default: 8000)" in up_help and "--no-install" in up_help


def test_local_switches_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_LOCAL_INSTALL", "false")
    up = local_cli(["up"])
    assert isinstance(up, UpSettings) and up.install is False
    assert local_cli(["up", "--install"]).install is True  # type: ignore[union-attr]
    monkeypatch.setenv("PDGATE_LOCAL_PORT", "not-a-port")
    with pytest.raises(ValidationError, match="port"):
        local_cli(["up"])
    assert local_cli(["venv", "--venv", "/v"]).venv is not None

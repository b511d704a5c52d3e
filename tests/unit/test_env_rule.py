"""One environment-variable rule for every pdgate command: `--some-flag` of `pdgate-<command>` is
`PDGATE_<COMMAND>_SOME_FLAG` (a flag wins), and the metaserver's older `PDGATE_<FLAG>` names still work."""

from __future__ import annotations

import pytest
from pdgate.deploy.local.launcher import build_parser as local_parser
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.settings import parse_cli as meta_cli
from pdgate.router.settings import RouterSettings
from pdgate.sim.settings import SimSettings


def test_port_of_every_command_follows_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix, port in (("ROUTER", 8101), ("METASERVER", 8102), ("LOCAL", 8103), ("SIM", 8104)):
        monkeypatch.setenv(f"PDGATE_{prefix}_PORT", str(port))
    assert RouterSettings().port == 8101
    assert MetaSettings().port == 8102
    assert local_parser().parse_args(["up"]).port == 8103
    assert SimSettings().port == 8104


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_METASERVER_PORT", "8102")
    monkeypatch.setenv("PDGATE_LOCAL_PORT", "8103")
    assert meta_cli(["--port", "9001"]).port == 9001
    assert local_parser().parse_args(["up", "--port", "9002"]).port == 9002


def test_the_metaservers_older_names_still_work_and_the_new_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_STORE", "redis://old:6379/0")
    monkeypatch.setenv("PDGATE_PORT", "7001")
    assert (MetaSettings().store, MetaSettings().port) == ("redis://old:6379/0", 7001)
    monkeypatch.setenv("PDGATE_METASERVER_PORT", "7002")
    assert MetaSettings().port == 7002


def test_local_switches_read_the_environment_and_help_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_LOCAL_EXIT_AFTER_DEMO", "1")
    monkeypatch.setenv("PDGATE_LOCAL_MODEL_DIR", "/models/qwen")
    args = local_parser().parse_args(["up"])
    assert args.exit_after_demo is True and str(args.model_dir) == "/models/qwen"
    up_help = local_parser()._subparsers._group_actions[0].choices["up"].format_help()  # type: ignore[union-attr]
    assert "PDGATE_LOCAL_PREFILL" in up_help and "random weights" in up_help

"""`pdgate-local up` as a launcher (issue #26 item 4), without booting vLLM: what command line each engine
gets from the flags, the name the model is served under, where the router listens, and that an
interrupted `up` says "stopped" once.

The engine's argv is built by the same functions `LocalStack._launch` calls (`stack_config`,
`engine_spec`, `VllmInstanceSpec.argv`); vLLM takes the last of a repeated flag, so the user's
arguments must come after pdgate's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdgate.deploy.local import launcher
from pdgate.deploy.local.launcher import DownSettings, StatusSettings, UpSettings, parse_cli, stack_config
from pdgate.deploy.local.stack import LocalStack, engine_spec, router_args, served_model_name
from pdgate.deploy.local.tiny_model import MODEL_NAME

PY = Path("/venv/bin/python")


def _up(argv: list[str]) -> UpSettings:
    settings = parse_cli(["up", *argv])
    assert isinstance(settings, UpSettings)
    return settings


def _argv(settings: UpSettings, role: str, model_dir: Path) -> list[str]:
    cfg = stack_config(settings.model_copy(update={"model_dir": model_dir}))
    spec = engine_spec(cfg, role, f"{role}-0", 9001, "0", "http://127.0.0.1:8000", Path("/tmp/s.json"), extra={})
    return spec.argv(PY, cfg.flags())


def _last(argv: list[str], flag: str) -> str:
    """The value vLLM's argparse keeps: the last one given."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag][-1]


def test_vllm_arguments_reach_every_engine_after_pdgates(tmp_path: Path) -> None:
    settings = _up(
        ["--prefill-args", "--max-num-seqs 4", "--decode-args=--enforce-eager", "--", "--max-model-len", "8192"]
    )
    prefill, decode = _argv(settings, "prefill", tmp_path), _argv(settings, "decode", tmp_path)
    for argv in (prefill, decode):
        assert argv.count("--max-model-len") == 2 and _last(argv, "--max-model-len") == "8192"
        assert argv.index("--kv-transfer-config") < len(argv) - 2  # pdgate's own flags come first
    assert _last(prefill, "--max-num-seqs") == "4" and _last(decode, "--max-num-seqs") != "4"
    assert decode[-1] == "--enforce-eager" and prefill[-1] == "4"


def test_vllm_args_from_the_environment_and_after_the_double_dash_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_LOCAL_VLLM_ARGS", "--dtype float32")
    settings = _up(["--", "--max-model-len", "8192", "--served-model-name", "has space"])
    cfg = stack_config(settings)
    assert cfg.engine_args == ("--dtype", "float32", "--max-model-len", "8192", "--served-model-name", "has space")


def test_arguments_after_the_double_dash_are_for_up_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(["model", "--", "--dtype", "float32"])
    assert info.value.code == 2 and "for `up` only" in capsys.readouterr().err


def test_a_checkpoint_is_served_under_its_folders_name(tmp_path: Path) -> None:
    qwen = tmp_path / "Qwen2.5-0.5B-Instruct"
    qwen.mkdir()
    (qwen / "config.json").write_text("{}")
    assert served_model_name(qwen) == "Qwen2.5-0.5B-Instruct"
    assert served_model_name(tmp_path / "not-built-yet") == MODEL_NAME  # the tiny model keeps its name
    assert _last(_argv(_up([]), "decode", qwen), "--served-model-name") == "Qwen2.5-0.5B-Instruct"
    assert _last(_argv(_up(["--served-model-name", "qwen"]), "prefill", qwen), "--served-model-name") == "qwen"


def test_host_is_where_the_router_listens_and_clients_here_reach_it(tmp_path: Path) -> None:
    cfg = stack_config(_up(["--host", "0.0.0.0", "--port", "8123"]), run_dir=tmp_path)
    args = router_args(cfg)
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8123"
    assert LocalStack(cfg, log=lambda _: None).url == "http://127.0.0.1:8123"
    named = stack_config(_up(["--host", "10.1.2.3"]), run_dir=tmp_path)
    assert LocalStack(named, log=lambda _: None).url == "http://10.1.2.3:8000"


def test_status_and_down_are_subcommands_with_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    assert isinstance(parse_cli(["status", "--state-file", str(path)]), StatusSettings)
    down = parse_cli(["down", "--state-file", str(path)])
    assert isinstance(down, DownSettings) and down.state_file == path


def test_an_interrupted_up_says_stopped_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #26: Ctrl-C printed 'stopped' twice (the launcher's `finally` and its signal handler both)."""

    def interrupted(self: LocalStack) -> LocalStack:
        raise launcher._Stop("SIGINT")

    monkeypatch.setattr(LocalStack, "start", interrupted)
    state_file = tmp_path / "state.json"
    code = launcher.main(["up", "--run-dir", str(tmp_path / "run"), "--state-file", str(state_file)])
    out = capsys.readouterr().out
    assert code == 130
    assert sum(line.endswith(" stopped") for line in out.splitlines()) == 1, out
    assert not state_file.exists(), "the state file goes with the launcher"


def test_up_records_itself_in_the_state_file_while_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, object]] = []
    state_file = tmp_path / "state.json"

    def look(self: LocalStack) -> LocalStack:
        seen.append(json.loads(state_file.read_text()))
        raise launcher._Stop("SIGTERM")

    monkeypatch.setattr(LocalStack, "start", look)
    assert launcher.main(["up", "--run-dir", str(tmp_path / "run"), "--state-file", str(state_file)]) == 143
    [recorded] = seen
    assert recorded["phase"] == "starting" and recorded["router"] == "http://127.0.0.1:8000"
    assert recorded["model"] == MODEL_NAME and recorded["run_dir"] == str((tmp_path / "run").resolve())


def test_the_operators_kv_cache_size_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Memory is vLLM's environment on CPU (VLLM_CPU_KVCACHE_SPACE, GiB): the operator's value is kept."""
    from pdgate.deploy.local.vllm_instance import vllm_base_env

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert vllm_base_env(tmp_path, kv_cache_gib=1)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "6")
    assert vllm_base_env(tmp_path, kv_cache_gib=1)["VLLM_CPU_KVCACHE_SPACE"] == "6"

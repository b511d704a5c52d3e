"""The local-stack tooling itself: the offline model build is reproducible and complete, process
health waits fail fast and name the process and its log, and the launcher refuses a broken venv
with a clear message instead of hanging.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pdgate.deploy.local.procs import ManagedProcess, ProcessFailed, free_port, wait_http
from pdgate.deploy.local.stack import ensure_model
from pdgate.deploy.local.vllm_env import VllmEnv, repo_root

pytestmark = pytest.mark.e2e


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_model_build_is_bit_for_bit_reproducible(model_dir: Path, tmp_path: Path, vllm_env: VllmEnv) -> None:
    again = ensure_model(tmp_path / "again", vllm_env, log=lambda _: None)
    assert _digests(again) == _digests(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["head_dim"] == 32 and config["max_position_embeddings"] >= 4096
    tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok["chat_template"]


def test_health_wait_fails_at_once_naming_the_dead_process_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    proc = ManagedProcess(
        "crasher",
        [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
        log_path=log,
    ).start()
    with pytest.raises(ProcessFailed) as err:
        wait_http(proc, f"http://127.0.0.1:{free_port()}/health", timeout_s=600)
    message = str(err.value)
    assert "crasher" in message and "status 3" in message
    assert str(log) in message and "boom: bad flag" in message


def test_launcher_refuses_a_missing_venv_without_installing(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv"
    flags = ["--venv", str(missing), "--no-install", "--port", str(free_port()), "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(
        [sys.executable, "-m", "pdgate.deploy.local.launcher", "up", *flags],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "FAILED" in out.stdout and str(missing) in out.stdout
    assert not missing.exists()


def test_launcher_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdgate.deploy.local.launcher",
                "up",
                "--port",
                str(port),
                "--run-dir",
                str(tmp_path),
            ],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 1
    assert f"port {port} is already in use" in out.stdout
    assert list(tmp_path.glob("*.log")) == []  # nothing was started

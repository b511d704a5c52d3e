"""The first set-up command keeps pip's output out of the terminal (issue #26 item 5): one line per step
there, pip's words in <venv>/pdgate-install.log, and a failed step names the log and shows its end.

A real pip run that fails at once without a network (the package is a wheel path that does not exist).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pdgate.deploy.local import vllm_env
from pdgate.deploy.local.vllm_env import VllmEnv, VllmEnvError, install_log


def test_pip_output_goes_to_the_log_and_a_failure_shows_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # an interpreter with pip: no venv step
    missing = tmp_path / "no_such_package-1.0-py3-none-any.whl"
    monkeypatch.setattr(vllm_env, "VLLM_PACKAGE", str(missing))
    said: list[str] = []
    with pytest.raises(VllmEnvError) as info:
        vllm_env._install(VllmEnv(venv), said.append)
    log = install_log(VllmEnv(venv))
    assert said == [f"[vllm-env 1/3] installing {missing} (downloads about 1 GB)"]  # one line, then the failure
    assert missing.name in log.read_text(), "pip's own error is in the log"
    assert str(log) in str(info.value) and missing.name in str(info.value).split("last lines of the log:")[1]
    captured = capfd.readouterr()
    assert missing.name not in captured.out + captured.err, "pip wrote to the terminal"

"""`pdgate-local status` / `down` over the state file (deploy/local/state.py), with real processes standing
in for the launcher and an engine: `down` stops the launcher with SIGTERM, kills what outlives the grace
period (each process leads its own session, as procs.py starts them), and never signals a process that
only reuses a recorded pid.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdgate.deploy.local import state
from pdgate.deploy.local.launcher import main

SLEEPER = "import time\nwhile True: time.sleep(1)"
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
    "while True: time.sleep(1)"
)


class Proc:
    """A real long-running process, reaped as soon as it exits (so it never lingers as a zombie)."""

    def __init__(self, code: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True
        )
        if "ready" in code:
            assert self.popen.stdout is not None and self.popen.stdout.readline().strip() == "ready"
        self.exited = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.popen.wait()
        self.exited.set()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        if not self.exited.is_set():
            self.popen.kill()
            self.exited.wait(10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for p in made:
        p.kill()


def _spawn(procs: list[Proc], code: str = SLEEPER) -> Proc:
    procs.append(Proc(code))
    return procs[-1]


def _write(path: Path, launcher: Proc, *engines: Proc) -> None:
    state.write_state(
        path,
        {
            "launcher": state.process_entry("launcher", launcher.pid),
            "phase": "ready",
            "router": "http://127.0.0.1:9",  # nothing listens: status says so and goes on
            "model": "pdgate-tiny",
            "run_dir": "/tmp/run",
            "cli_config": "/tmp/cli.toml",
            "processes": [state.process_entry(f"decode-{i}", e.pid) for i, e in enumerate(engines)],
        },
    )


def test_status_names_each_process_and_down_stops_the_launcher(
    tmp_path: Path, procs: list[Proc], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "local.json"
    launcher, engine = _spawn(procs), _spawn(procs)
    _write(path, launcher, engine)
    assert main(["status", "--state-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"launcher pid {launcher.pid}" in out and f"pid {engine.pid}" in out and "running" in out
    assert main(["down", "--state-file", str(path)]) == 0
    assert launcher.exited.wait(10) and launcher.popen.returncode == -signal.SIGTERM
    assert engine.exited.wait(10), "a recorded process left running after the launcher is killed"
    assert not path.exists()
    assert main(["status", "--state-file", str(path)]) == 1
    assert main(["down", "--state-file", str(path)]) == 0  # nothing to stop is not an error


def test_down_kills_what_ignores_sigterm_after_the_grace_period(tmp_path: Path, procs: list[Proc]) -> None:
    path = tmp_path / "local.json"
    launcher = _spawn(procs, STUBBORN)
    _write(path, launcher)
    assert state.down(path, say=lambda _: None, grace_s=0.5) == 0
    assert launcher.exited.wait(10) and launcher.popen.returncode == -signal.SIGKILL


def test_a_reused_pid_is_not_signalled(tmp_path: Path, procs: list[Proc], capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "local.json"
    bystander = _spawn(procs)
    entry = state.process_entry("launcher", bystander.pid)
    state.write_state(path, {"launcher": {**entry, "start": str(int(entry["start"]) - 1)}, "processes": []})
    assert main(["status", "--state-file", str(path)]) == 1 and "is gone" in capsys.readouterr().out
    assert main(["down", "--state-file", str(path)]) == 0
    assert not bystander.exited.wait(0.5), "down signalled a process that merely has the recorded pid"


def test_a_second_up_from_the_same_directory_is_refused(
    tmp_path: Path, procs: list[Proc], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "local.json"
    _write(path, _spawn(procs))
    assert main(["up", "--state-file", str(path), "--run-dir", str(tmp_path / "run")]) == 1
    assert "pdgate-local down` first" in capsys.readouterr().out

"""The local stack's state file, and `pdgate-local status` / `pdgate-local down` that read it.

Why a file: `pdgate-local up --detach` returns while the stack runs on in the background, and a stack
started in the foreground may be looked at or stopped from another shell; both need to find the
launcher (the supervisor: it stops every engine when it gets SIGTERM) and what it started. The file is
`.pdgate/local.json` in the directory `up` was run from, beside the `pdgate` command's `cli.toml`; the
launcher writes it once its processes exist, marks it ready when the stack serves, removes it on exit.

Each process is recorded with its pid and its start time (/proc/<pid>/stat), so `down` never signals a
process that merely reuses a recorded pid after a reboot or a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "STATE_FILE",
    "alive",
    "down",
    "proc_start",
    "process_entry",
    "read_state",
    "remove_state",
    "status",
    "write_state",
]

STATE_FILE = Path(".pdgate") / "local.json"

Say = Callable[[str], None]


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] == "Z":  # a zombie has exited: only its parent's wait is missing
        return None
    return fields[19]


def alive(entry: Mapping[str, Any]) -> bool:
    """Whether the recorded process (`pid`, `start`) still runs: the same pid AND the same start time."""
    pid = entry.get("pid")
    return isinstance(pid, int) and proc_start(pid) is not None and proc_start(pid) == entry.get("start")


def process_entry(name: str, pid: int, **extra: Any) -> dict[str, Any]:
    """A process as the state file records it."""
    return {"name": name, "pid": pid, "start": proc_start(pid), **extra}


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write the state file whole (a temporary file renamed over it: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(state), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_state(path: Path, pid: int) -> None:
    """Remove the state file if it is still `pid`'s (a newer launcher's is left alone)."""
    state = read_state(path)
    if state is not None and state.get("launcher", {}).get("pid") == pid:
        path.unlink(missing_ok=True)


def status(path: Path, say: Say = print) -> int:
    """Say what runs from `path`; 0 when the launcher runs, 1 when no stack runs from here."""
    state = read_state(path)
    if state is None:
        say(f"no local stack started from here ({path} not found)")
        return 1
    launcher = state.get("launcher", {})
    if not alive(launcher):
        say(f"not running: the launcher (pid {launcher.get('pid')}) is gone; `pdgate-local down` clears {path}")
        return 1
    router, phase = str(state.get("router", "")), state.get("phase", "starting")
    say(f"running: {state.get('model')} on {router}/v1 ({phase}), launcher pid {launcher['pid']}")
    with contextlib.suppress(httpx.HTTPError):
        health = httpx.get(router + "/health", timeout=5, trust_env=False)
        say(f"router /health: {health.status_code} ({'a pair is ready' if health.status_code == 200 else 'not ready'})")
    for p in state.get("processes", []):
        where = f" {p['url']}" if p.get("url") else ""
        say(f"  {p['name']:<12} pid {p['pid']:<8} {'running' if alive(p) else 'GONE'}{where}")
    say(f"logs: {state.get('run_dir')}; admin token: {state.get('cli_config')}")
    return 0


def down(path: Path, say: Say = print, grace_s: float = 60.0) -> int:
    """Stop the stack started from here: SIGTERM to the launcher (it stops its engines and router), then
    SIGKILL to any recorded process still running after `grace_s`. 0 when nothing runs any more."""
    state = read_state(path)
    if state is None:
        say(f"nothing to stop: no local stack started from here ({path} not found)")
        return 0
    launcher = state.get("launcher", {})
    if alive(launcher):
        say(f"stopping the stack (launcher pid {launcher['pid']}; it stops the router and the engines)")
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher["pid"], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = [p for p in [launcher, *state.get("processes", [])] if alive(p)]
    for p in left:  # the launcher did not finish in time: each process leads its own group (procs.py)
        say(f"{p.get('name', 'launcher')} (pid {p['pid']}) still runs: SIGKILL")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p["pid"], signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p["pid"], signal.SIGKILL)
    path.unlink(missing_ok=True)
    say("stopped")
    return 0

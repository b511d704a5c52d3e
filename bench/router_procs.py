"""bench/router.py's processes: start them (optionally pinned to CPUs), read their CPU time, stop them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.procs import end

__all__ = [
    "CLK",
    "LOGS",
    "PY",
    "ROOT",
    "Procs",
    "cpu_seconds",
    "cpus",
    "start_profile",
    "summarize_profile",
    "tree_cpu_seconds",
]

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLK = os.sysconf("SC_CLK_TCK")
LOGS = Path(tempfile.mkdtemp(prefix="pdgate-bench-router-"))


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def pinned(cmd: list[str], cpu: str, pin: bool) -> list[str]:
    """`cmd` under taskset on `cpu` when pinning (off by default: on a shared 2-vCPU VM it added latency)."""
    if pin and cpus() > 1 and shutil.which("taskset"):
        return ["taskset", "-c", cpu, *cmd]
    return cmd


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def _threads_cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of `pid`, in ns from /proc/<pid>/task/<tid>/schedstat: /proc's
    utime/stime count in clock ticks (10 ms), too coarse for a few hundred requests of 100 us each."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live children (the workers of `pdgate-router --workers N`), all threads."""
    total = _threads_cpu_seconds(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += _threads_cpu_seconds(int(child))
        except FileNotFoundError:
            pass
    return total


class Procs:
    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], cpu: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (LOGS / f"{name}.log").open("wb")
        full_env = {**os.environ, **env} if env else None
        # A baseline tree (PYTHONPATH=DIR) must also be the working directory: `python -m` puts the working
        # directory first on sys.path, and the repository root's own `pdgate/` would shadow DIR's.
        cwd = env["PYTHONPATH"] if env and "PYTHONPATH" in env else ROOT
        proc = subprocess.Popen(pinned(cmd, cpu, self.pin), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=full_env)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        end(reversed(self.procs), timeout=15)


def start_profile(pid: int, seconds: int, raw_out: Path) -> subprocess.Popen[bytes]:
    """py-spy (from the bench venv, `bench/peers_env.py`) sampling `pid` for `seconds`, collapsed stacks
    (`--format raw`) to `raw_out`; `--nonblocking` so the sampled router is never paused."""
    from bench.peers_env import ensure, peer_binary

    ensure(quiet=True)
    spy = peer_binary("py-spy")
    assert spy is not None
    cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "250"]
    cmd += ["--format", "raw", "--nonblocking", "--output", str(raw_out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_profile(raw: Path, top: int = 15) -> str:
    """The `top` frames by own time (the innermost frame of each sampled stack), and by total time
    (any stack that holds the frame), from py-spy's collapsed output."""
    own: dict[str, int] = {}
    own_fn: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        fn = frames[-1].rsplit(":", 1)[0] + ")" if ":" in frames[-1] else frames[-1]
        own_fn[fn] = own_fn.get(fn, 0) + n
        for f in set(frames):
            total[f] = total.get(f, 0) + n
    lines = [f"{samples} samples", "", f"top {top} by own time:"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{n / samples * 100:6.1f}%  {f}")
    lines += ["", f"top {top} functions by own time (all lines of a function together):"]
    for f, n in sorted(own_fn.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{n / samples * 100:6.1f}%  {f}")
    lines += ["", f"top {top + 10} frames by total time:"]
    for f, n in sorted(total.items(), key=lambda kv: -kv[1])[: top + 10]:
        lines.append(f"{n / samples * 100:6.1f}%  {f}")
    return "\n".join(lines) + "\n"

"""bench/router.py's processes: start them (optionally pinned to CPUs), read their CPU time, stop them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["CLK", "LOGS", "PY", "ROOT", "Procs", "cpu_seconds", "cpus", "tree_cpu_seconds"]

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


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live children (the workers of `pdgate-router --workers N`)."""
    total = cpu_seconds(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += cpu_seconds(int(child))
        except FileNotFoundError:
            pass
    return total


class Procs:
    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], cpu: str) -> subprocess.Popen[bytes]:
        log = (LOGS / f"{name}.log").open("wb")
        proc = subprocess.Popen(pinned(cmd, cpu, self.pin), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

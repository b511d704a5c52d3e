"""Ending the processes a test or benchmark started: all asked at once, each waited for, killed if it lingers.

Why one function: the redis-servers, Sentinel groups and benchmark stacks each had a copy of this loop, and
a server a test froze with SIGSTOP took the whole wait before its kill (SIGTERM waits for SIGCONT).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable

__all__ = ["end"]


def end(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 5.0) -> None:
    """SIGCONT and SIGTERM to every one still running (so they exit in parallel), then wait for each;
    one that has not exited within `timeout` is killed."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a stopped process would hold the SIGTERM until the kill
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""Child processes of the local stack: one session each, logs in files, health waits that fail fast.

Each child runs in its own session (its pid is its process-group id), so stopping it reaches the
processes it spawned too (vLLM's EngineCore and worker). A health wait checks the child between polls:
a server that crashed is reported at once, with its name, its log path and the end of its log,
instead of after the full timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

__all__ = ["ManagedProcess", "ProcessFailed", "free_port", "port_is_free", "stop_all", "wait_http"]

_PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    """A child exited or never became healthy; the message names it and points at its log."""

    def __init__(self, proc: ManagedProcess, why: str) -> None:
        self.proc = proc
        self.why = why
        tail = proc.log_tail(25)
        super().__init__(f"{proc.name}: {why}\n  log: {proc.log_path}\n  last lines of the log:\n{tail}")


# Ports handed out below the kernel's ephemeral range start here (clear of the well-known and most
# registered services' ports, which sit lower).
_LOWEST_PORT = 12000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections' local ports, `bind(0)`)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", *, span: int = 0) -> int:
    """A port nobody listens on now, chosen below the kernel's ephemeral range (ports `span` above it too).

    Why not `bind(0)`: the kernel hands the same port out again, as the local port of any outgoing
    connection on the machine. A server that binds it seconds later (a vLLM engine binds its HTTP
    port only after loading, about 40 s on two cores) can then find it taken by a client socket;
    a Redis Sentinel that exited that way cost CI a run. A random port under the range is never
    handed out by the kernel, so only another process choosing the same one can race for it."""
    lo, _ = ephemeral_range()
    top = lo - 1 - span
    if top - _LOWEST_PORT >= 1000:
        for _ in range(200):
            port = random.randint(_LOWEST_PORT, top)
            if all(port_is_free(p, host) for p in {port, port + span}):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a host configured without that room
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (a listener there would answer our health checks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """Runs in the child before exec: new session, and SIGTERM when the launcher dies."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ManagedProcess:
    """One named child process with its log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def start(self) -> ManagedProcess:
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self._popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                preexec_fn=_die_with_parent,  # setsid + PDEATHSIG; runs before exec
            )
        self.started_at = time.monotonic()
        return self

    def returncode(self) -> int | None:
        """None while running; the exit status once it has exited."""
        return self._popen.poll() if self._popen else None

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "    (no log)"
        return "\n".join("    " + ln for ln in text.splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        if self._popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole group, wait `grace_s`, then SIGKILL what is left."""
        if self._popen is None:
            return
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # The leader may be gone while its children (EngineCore, workers) linger: kill the group anyway.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)


def stop_all(procs: Sequence[ManagedProcess], grace_s: float = 15.0) -> None:
    """Stop several children at once: TERM to all, one shared grace period, then KILL."""
    for p in procs:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        p.stop(grace_s=0)


def wait_http(
    proc: ManagedProcess,
    url: str,
    *,
    timeout_s: float,
    ready: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    what: str = "healthy",
    others: Sequence[ManagedProcess] = (),
    headers: Mapping[str, str] | None = None,
) -> float:
    """Poll `url` until `ready(response)`; return the seconds waited.

    Raises ProcessFailed at once when `proc` (or one of `others`, which the readiness depends on)
    exits, and when `timeout_s` passes.
    """
    start = time.monotonic()
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            for p in (proc, *others):
                code = p.returncode()
                if code is not None:
                    raise ProcessFailed(p, f"exited with status {code} while waiting for {proc.name} to be {what}")
            with contextlib.suppress(httpx.HTTPError):
                if ready(client.get(url, headers=headers)):
                    return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise ProcessFailed(proc, f"not {what} after {timeout_s:.0f} s ({url})")
            time.sleep(0.5)

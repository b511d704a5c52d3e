"""RedisServer: a real `redis-server` on a free loopback port, for tests and benchmarks.

No persistence (`--save '' --appendonly no`), so a restart starts empty, like a failed-over Redis
without replicas. `restart()` keeps the port, so clients configured with the URL reconnect to it.

    with RedisServer() as server:
        url = server.url            # redis://127.0.0.1:PORT/0
        server.restart()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.ports import free_port
from tests.support.procs import end

__all__ = ["REDIS_SERVER", "RedisServer", "answers_ping"]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def answers_ping(port: int) -> bool:
    """True when a Redis (or a Sentinel) on 127.0.0.1:`port` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, port: int | None = None, *, extra_args: list[str] | None = None) -> None:
        self.port = port or free_port()
        # A port we chose may be taken by the time the server binds it: then take another, but only
        # before the first start (a restart must keep the port its clients know).
        self._may_move = port is None
        self.extra_args = extra_args or []
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pdgate-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        cmd = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", str(Path(self._dir.name) / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not answers_ping(self.port):
            if self._proc.poll() is not None:
                log = Path(self._dir.name, "redis.log")
                text = log.read_text() if log.exists() else ""
                if self._may_move and "Address already in use" in text:
                    self._may_move, self._proc, self.port = False, None, free_port()
                    return self.start(timeout)
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {text[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server on port {self.port} did not answer PING within {timeout} s")
            time.sleep(0.01)
        self._may_move = False
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        end([proc])  # a frozen (SIGSTOP) server too

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

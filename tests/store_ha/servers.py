"""Real Redis topologies on loopback for the store tests: a Sentinel group and a three-master Cluster.

Both are made of `tests.support.redis.RedisServer` processes (no persistence, own temp dir, free port),
so nothing here is a fake: `SentinelGroup` is a master, one replica and three `redis-server --sentinel`
processes with short detection times; `RedisClusterServers` is three `--cluster-enabled yes` servers
joined by `redis-cli --cluster create`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.ports import free_port
from tests.support.redis import RedisServer

__all__ = ["BOUND_S", "RedisClusterServers", "SentinelGroup", "crash", "redis_cli"]

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
SERVICE = "pdgate-master"


# Upper bounds on waits for servers to come up (not speed checks): generous, because the test machine
# may be shared and loaded (two cores, load average above 10 seen).
BOUND_S = 60.0


def redis_cli(port: int, *args: str, timeout: float = 30.0) -> str:
    """One redis-cli command against 127.0.0.1:port; its stdout (raises on a non-zero exit)."""
    out = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout.strip()


def crash(server: RedisServer) -> None:
    """SIGKILL, as a machine that dies: no shutdown, no last write to anyone."""
    proc = server._proc
    assert proc is not None, "server not running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    server._proc = None


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis needs both below 65536."""
    while True:
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(what: str, ok: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok():  # type: ignore[operator]
                return
        except (subprocess.SubprocessError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout} s")


class SentinelGroup:
    """A master, one replica and three Sentinels (quorum 2) watching it as `SERVICE`.

    Detection is fast (`down-after-milliseconds` 1000; lower makes Sentinels on a loaded two-core test
    machine mistake a slow answer for a dead master) so a failover takes two to three seconds."""

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.master = RedisServer()
        self.replica = RedisServer(extra_args=["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"])
        self.down_after_ms = down_after_ms
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self._dirs: list[Path] = []

    def start(self) -> SentinelGroup:
        """Start everything; on any failure, stop what did start (a fixture that raises is never closed)."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> SentinelGroup:
        self.master.start(BOUND_S)
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start(BOUND_S)
        _wait(
            "replica in sync",
            lambda: "master_link_status:up" in redis_cli(self.replica.port, "info", "replication"),
            BOUND_S,
        )
        for port in self.sentinel_ports:
            d = Path(self.master._dir.name) / f"sentinel-{port}"
            d.mkdir()
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 2000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            cmd = [shutil.which("redis-server") or "/usr/bin/redis-server", str(conf), "--sentinel"]
            self._sentinels.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self._dirs.append(d)
        for port in self.sentinel_ports:  # every Sentinel knows the replica and the two other Sentinels
            _wait(
                "sentinels discovered each other and the replica",
                lambda p=port: (
                    _sentinel_field(p, "num-other-sentinels") == "2" and _sentinel_field(p, "num-slaves") == "1"
                ),
                BOUND_S,
            )
        return self

    @property
    def url_hosts(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    def url(self, prefix: str) -> str:
        return f"redis+sentinel://{self.url_hosts}/{SERVICE}/0?prefix={prefix}"

    def master_port(self) -> int:
        """The master as the first Sentinel sees it now."""
        host_port = redis_cli(self.sentinel_ports[0], "sentinel", "get-master-addr-by-name", SERVICE).split()
        return int(host_port[1])

    def sentinel_log(self, lines: int = 30) -> str:
        """The first Sentinel's last log lines (why a failover did or did not happen)."""
        log = self._dirs[0] / "sentinel.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def close(self) -> None:
        for proc in self._sentinels:
            proc.terminate()
        for proc in self._sentinels:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.replica.close()
        self.master.close()


def _sentinel_field(port: int, name: str) -> str:
    lines = redis_cli(port, "sentinel", "master", SERVICE).splitlines()
    return dict(zip(lines[::2], lines[1::2], strict=False)).get(name, "")


_CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")


class RedisClusterServers:
    """Three masters, no replicas, the 16384 slots split evenly by `redis-cli --cluster create`."""

    def __init__(self, size: int = 3) -> None:
        self.servers = [RedisServer(cluster_port(), extra_args=list(_CLUSTER_ARGS)) for _ in range(size)]

    def start(self) -> RedisClusterServers:
        """Start and join the three; on any failure, stop what did start."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> RedisClusterServers:
        for server in self.servers:
            server.start(BOUND_S)
        addrs = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for s in self.servers:
            _wait("cluster_state:ok", lambda s=s: "cluster_state:ok" in redis_cli(s.port, "cluster", "info"), BOUND_S)
        return self

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def url(self, prefix: str, **options: str) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])  # two seeds: the client finds the rest
        extra = "".join(f"&{k}={v}" for k, v in options.items())
        return f"redis+cluster://{hosts}/0?prefix={prefix}{extra}"

    def node_id(self, port: int) -> str:
        return redis_cli(port, "cluster", "myid")

    def owner(self, slot: int) -> int:
        """The port of the master that owns `slot` now."""
        for line in redis_cli(self.ports[0], "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for rng in fields[8:]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return port
        raise LookupError(f"no owner for slot {slot}")

    def close(self) -> None:
        for s in self.servers:
            s.close()

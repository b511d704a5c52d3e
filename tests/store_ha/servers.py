"""Real Redis topologies on loopback for the store tests: a Sentinel group and a three-master Cluster.

Both are made of `tests.support.redis.RedisServer` processes (no persistence, own temp dir, free port),
so nothing here is a fake: `SentinelGroup` is a master, one replica and three `redis-server --sentinel`
processes with short detection times; `RedisClusterServers` is three `--cluster-enabled yes` servers
joined by `redis-cli --cluster create`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Self

from tests.support.ports import free_port, wait_until
from tests.support.procs import end
from tests.support.redis import RedisServer, answers_ping

__all__ = [
    "BOUND_S",
    "Cli",
    "Group",
    "RedisClusterServers",
    "SentinelGroup",
    "crash",
    "redis_cli",
    "sentinel_field",
    "wait_for",
    "wait_replica_in_sync",
    "wait_sentinels_formed",
]

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
    """A free port whose cluster bus port (+10000) is free too (both below the kernel's ephemeral range)."""
    return free_port(span=10000)


Cli = Callable[..., str]  # (port, *args): one redis-cli command's stdout, as `redis_cli` (plain) or over TLS


def wait_for(what: str, check: Callable[[], bool]) -> None:
    """Poll `check` until it holds, up to BOUND_S (what is still starting may refuse a command meanwhile)."""
    wait_until(check, timeout=BOUND_S, interval=0.05, what=what)


def sentinel_field(cli: Cli, port: int, name: str) -> str:
    """One field of the Sentinel on `port`'s view of SERVICE ("" when it has none yet)."""
    lines = cli(port, "sentinel", "master", SERVICE).splitlines()
    return dict(zip(lines[::2], lines[1::2], strict=False)).get(name, "")


def _up_or_exited(proc: subprocess.Popen[bytes], port: int) -> bool:
    return proc.poll() is not None or answers_ping(port)


def wait_replica_in_sync(cli: Cli, replica_port: int) -> None:
    """Until the replica's link to its master is up: a failover before that would promote an empty replica."""
    wait_for("replica in sync", lambda: "master_link_status:up" in cli(replica_port, "info", "replication"))


def wait_sentinels_formed(cli: Cli, sentinel_ports: list[int]) -> None:
    """Until every Sentinel knows the replica and the two other Sentinels: only then can a quorum of 2 act."""

    def formed(port: int) -> bool:
        return (
            sentinel_field(cli, port, "num-other-sentinels") == "2" and sentinel_field(cli, port, "num-slaves") == "1"
        )

    def view(port: int) -> str:
        try:
            return f"{port}: {sentinel_field(cli, port, 'num-other-sentinels')} other Sentinels, " + (
                f"{sentinel_field(cli, port, 'num-slaves')} replicas, flags {sentinel_field(cli, port, 'flags')}"
            )
        except Exception as exc:  # a Sentinel that does not answer is what the message shows
            return f"{port}: no answer ({exc})"

    for port in sentinel_ports:
        try:
            wait_for("Sentinels found the replica and each other", partial(formed, port))
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; each Sentinel's view: {'; '.join(map(view, sentinel_ports))}") from None


class Group:
    """Servers started together: `start()` runs the subclass's `_start()` and, on any failure, closes what
    did start (a fixture whose set-up raises is never torn down)."""

    def start(self) -> Self:
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SentinelGroup(Group):
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

    def _start(self) -> Self:
        self.master.start(BOUND_S)
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start(BOUND_S)
        wait_replica_in_sync(redis_cli, self.replica.port)
        for i in range(len(self.sentinel_ports)):
            self._start_sentinel(i)
        wait_sentinels_formed(redis_cli, self.sentinel_ports)
        return self

    def _start_sentinel(self, i: int) -> None:
        """Sentinel `i`, answering PING; a port taken since it was chosen gets a fresh one (as RedisServer)."""
        for _ in range(3):
            port = self.sentinel_ports[i]
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
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._sentinels.append(proc)
            self._dirs.append(d)
            wait_for(f"Sentinel on {port} answers or exits", partial(_up_or_exited, proc, port))
            if proc.poll() is None:
                return
            log = d / "sentinel.log"
            if "Address already in use" not in (log.read_text() if log.exists() else ""):
                raise RuntimeError(f"Sentinel on {port} exited with {proc.returncode}: see {log}")
            self._sentinels.remove(proc)
            self._dirs.remove(d)
            self.sentinel_ports[i] = free_port()
        raise RuntimeError(f"no free port for Sentinel {i} in three tries")

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
        end(self._sentinels)
        self.replica.close()
        self.master.close()


_CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")


class RedisClusterServers(Group):
    """Three masters, no replicas, the 16384 slots split evenly by `redis-cli --cluster create`."""

    def __init__(self, size: int = 3) -> None:
        self.servers = [RedisServer(cluster_port(), extra_args=list(_CLUSTER_ARGS)) for _ in range(size)]

    def _start(self) -> Self:
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
            wait_for(
                "cluster_state:ok",
                partial(lambda port: "cluster_state:ok" in redis_cli(port, "cluster", "info"), s.port),
            )
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

"""Hosts made of Linux network namespaces, for rehearsing a multi-host deployment on one machine.

`Cluster` creates one namespace per host, joined by a bridge that lives in the first (the head), on a
private subnet. Nothing is attached to the root namespace: no address, route or veth end is left
there, so the rehearsal's traffic stays inside its namespaces and two runs never see each other.

`ip netns exec NS` also bind-mounts `/etc/netns/NS/hosts` over `/etc/hosts` for the command it runs;
`Cluster.hosts_file` uses that to give a namespace the names Docker's embedded DNS would resolve
(service names of the compose file).

Clean-up is reliable by construction: `close()` kills every process still in each namespace (by
`ip netns pids`, so a child that escaped its process group goes too), deletes the namespaces (which
deletes the bridge and the veths inside them) and the /etc/netns folders; it runs on any failure of
`start()` as well.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "Host", "NetnsError", "Proc"]

IP = shutil.which("ip") or "/usr/sbin/ip"
ETC_NETNS = Path("/etc/netns")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    result = subprocess.run([IP, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class Proc:
    """A process started inside a namespace, in its own session (so its group can be signalled)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class Host:
    """One namespace: a name for humans, the namespace name and its address on the bridge."""

    role: str
    netns: str
    addr: str
    procs: list[Proc] = field(default_factory=list)

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str], timeout: float = 30, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command to completion inside this host."""
        return subprocess.run(
            [IP, "netns", "exec", self.netns, *argv],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input.decode() if input is not None else None,
            check=False,
        )

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log_dir: Path) -> Proc:
        """Start a long-running command inside this host; its output goes to log_dir/<role>-<name>.log."""
        log = log_dir / f"{self.role}-{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [IP, "netns", "exec", self.netns, *argv],
                env=dict(env),
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(f"{self.role}/{name}", popen, log)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """Kill every process of this host: what a host that loses power does to its services."""
        for proc in self.procs:
            proc.kill()
        self.procs.clear()
        self._kill_stragglers()

    def _kill_stragglers(self) -> None:
        out = subprocess.run([IP, "netns", "pids", self.netns], capture_output=True, text=True, check=False)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


class Cluster:
    """Namespaces `<prefix>-<role>` on `subnet.0/24`; the first host holds the bridge and `.1`."""

    def __init__(self, roles_and_octets: Sequence[tuple[str, int]], *, subnet: str = "10.77.0") -> None:
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root (deselect with -m 'not netns')")
        # Interface names are limited to 15 characters: keep the prefix short and unique per run.
        self.prefix = f"pg{secrets.token_hex(3)}"
        self.subnet = subnet
        self.hosts = [Host(role, f"{self.prefix}-{role}", f"{subnet}.{octet}") for role, octet in roles_and_octets]
        self._created: list[str] = []

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def host(self, role: str) -> Host:
        return next(h for h in self.hosts if h.role == role)

    def start(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            self._created.append(host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
        head = self.head
        bridge = "br0"
        _ip("-n", head.netns, "link", "add", bridge, "type", "bridge")
        _ip("-n", head.netns, "addr", "add", f"{head.addr}/24", "dev", bridge)
        _ip("-n", head.netns, "link", "set", bridge, "up")
        for i, host in enumerate(self.hosts[1:], 1):
            port = f"{self.prefix}v{i}"
            # Both ends are created directly in their namespaces: nothing appears in the root namespace.
            _ip("-n", head.netns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("-n", head.netns, "link", "set", port, "master", bridge)
            _ip("-n", head.netns, "link", "set", port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")

    def hosts_file(self, host: Host, names: Mapping[str, str]) -> None:
        """Name -> address entries for `host`, seen by every command run through `ip netns exec`."""
        folder = ETC_NETNS / host.netns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{host.addr} {host.role}"]
        lines += [f"{addr} {name}" for name, addr in names.items()]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        for host in reversed(self.hosts):
            host.kill_all()
        for netns in reversed(self._created):
            for attempt in range(20):
                result = subprocess.run([IP, "netns", "del", netns], capture_output=True, check=False)
                if result.returncode == 0:
                    break
                time.sleep(0.1 * (attempt + 1))
        self._created.clear()
        for host in self.hosts:
            shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces or /etc/netns folders of this run still present (empty after close())."""
        out = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, check=False).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        left = [h.netns for h in self.hosts if h.netns in names]
        left += [str(ETC_NETNS / h.netns) for h in self.hosts if (ETC_NETNS / h.netns).exists()]
        return left

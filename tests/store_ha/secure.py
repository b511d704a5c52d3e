"""A Sentinel group with passwords and TLS only (no plain port anywhere), for the credential plumbing.

Certificates come from `openssl` (a CA and one server certificate for 127.0.0.1, used by every server).
Servers are real redis-server processes; each is ready when `redis-cli --tls -a ...` answers PONG.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Self

from tests.store_ha.servers import REDIS_CLI, SERVICE, Group, wait_for, wait_replica_in_sync, wait_sentinels_formed
from tests.support.ports import free_port
from tests.support.procs import end

__all__ = ["SecureSentinelGroup"]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
DATA_PASSWORD = "data-pw-1"
SENTINEL_PASSWORD = "sentinel-pw-2"


def _certs(d: Path) -> tuple[Path, Path, Path]:
    ca_key, ca, key, csr, cert = d / "ca.key", d / "ca.pem", d / "server.key", d / "server.csr", d / "server.pem"
    ext = d / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pdgate-test-ca",
        "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return ca, cert, key


class SecureSentinelGroup(Group):
    """Master + replica (password DATA_PASSWORD) and three Sentinels (password SENTINEL_PASSWORD), TLS only."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="pdgate-tls-")
        self.root = Path(self._dir.name)
        self.ca, self.cert, self.key = _certs(self.root)
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._procs: list[subprocess.Popen[bytes]] = []

    def _tls(self) -> str:
        return (
            f"tls-cert-file {self.cert}\ntls-key-file {self.key}\ntls-ca-cert-file {self.ca}\n"
            "tls-auth-clients no\ntls-replication yes\n"
        )

    def cli(self, port: int, password: str, *args: str) -> str:
        cmd = [REDIS_CLI, "--tls", "--cacert", str(self.ca), "-h", "127.0.0.1", "-p", str(port)]
        cmd += ["--no-auth-warning", "-a", password, *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout.strip()

    def _start_server(self, name: str, conf: str, port: int, password: str, *, sentinel: bool = False) -> None:
        d = self.root / name
        d.mkdir()
        path = d / "redis.conf"
        path.write_text(f"port 0\ntls-port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'log'}\n{self._tls()}{conf}")
        cmd = [REDIS_SERVER, str(path)] + (["--sentinel"] if sentinel else [])
        self._procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(f"{name} answers over TLS", lambda: self.cli(port, password, "ping") == "PONG")

    def data_cli(self, port: int, *args: str) -> str:
        return self.cli(port, DATA_PASSWORD, *args)

    def sentinel_cli(self, port: int, *args: str) -> str:
        return self.cli(port, SENTINEL_PASSWORD, *args)

    def _start(self) -> Self:
        data = f"save ''\nappendonly no\nrequirepass {DATA_PASSWORD}\nmasterauth {DATA_PASSWORD}\n"
        self._start_server("master", data, self.master_port, DATA_PASSWORD)
        replica = data + f"replicaof 127.0.0.1 {self.master_port}\n"
        self._start_server("replica", replica, self.replica_port, DATA_PASSWORD)
        wait_replica_in_sync(self.data_cli, self.replica_port)
        for i, port in enumerate(self.sentinel_ports):
            conf = (
                f"requirepass {SENTINEL_PASSWORD}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel auth-pass {SERVICE} {DATA_PASSWORD}\n"
                f"sentinel sentinel-pass {SENTINEL_PASSWORD}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            )
            self._start_server(f"sentinel-{i}", conf, port, SENTINEL_PASSWORD, sentinel=True)
        wait_sentinels_formed(self.sentinel_cli, self.sentinel_ports)
        return self

    def url(self, prefix: str) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return (
            f"rediss+sentinel://:{DATA_PASSWORD}@{hosts}/{SERVICE}/0?prefix={prefix}"
            f"&sentinel_password={SENTINEL_PASSWORD}&ssl_ca_certs={self.ca}"
        )

    def close(self) -> None:
        end(self._procs)
        self._dir.cleanup()

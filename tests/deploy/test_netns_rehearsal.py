"""Rehearsal of the multi-host layout of deploy/README.md, without Docker, across network namespaces.

Four namespaces stand for four hosts on one bridge (10.77.0.0/24): the head (.1) and two prefill hosts
(.11, .12) and a decode host (.21), as in the README's step by step. Every process runs the command
and environment that `docker-compose config` renders for its service from the shipped env files
(`deploy/env/*.env`); only the addresses are overridden (PDGATE_HEAD_ADDR, PDGATE_HOST_ADDR), the
way a second host of a role reuses its file. What Docker would add is emulated and nothing else:
  - compose's service-name DNS on the head's network: /etc/netns/<head>/hosts maps redis, metaserver
    and router to the head's loopback;
  - published ports: each head service listens on its published port (the env files publish them
    1:1, which the test asserts);
  - `depends_on: condition: service_healthy`: a head service starts once the rendered healthcheck of
    its dependency passes;
  - the engine images' entrypoint: `pdgate-engine` (deploy/docker/engine_cmd.py) with flavour `sim`,
    which waits for the metaserver across the bridge and then runs pdgate-sim.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.netns import Cluster, Host, NetnsError, Proc
from tests.deploy.support import DOCKER_DIR, ENV_FILES, REPO, published_ports, read_env_file, render

pytestmark = pytest.mark.netns

VENV_BIN = Path(sys.executable).parent
HEAD_ADDR = "10.77.0.1"
ENGINE_HOSTS = (("prefill-a", "prefill", 11), ("prefill-b", "prefill", 12), ("decode-a", "decode", 21))


@dataclass
class Rehearsal:
    cluster: Cluster
    tmp: Path
    env: dict[str, str]  # base process environment (PATH with the image's command names)
    head_services: dict[str, Any]
    engine_services: dict[str, dict[str, Any]]  # host role -> rendered service
    engines: dict[str, Proc]
    lease_s: float

    @property
    def head(self) -> Host:
        return self.cluster.head

    def client(self, command: str, *args: str, timeout: float = 90) -> Any:
        """Run tests/deploy/head_client.py COMMAND in the head's namespace; its last JSON line."""
        argv = [sys.executable, "-m", "tests.deploy.head_client", command, *args]
        result = self.head.run(argv, env=self.env, timeout=timeout)
        assert result.returncode == 0, f"head client {command} failed:\n{result.stdout}\n{result.stderr}"
        return json.loads(result.stdout.strip().splitlines()[-1])

    def wait_router(self, expected: list[str], timeout: float) -> None:
        token = self.head_services["metaserver"]["environment"]["PDGATE_METASERVER_ADMIN_TOKEN"]
        got = self.client("wait-router", json.dumps(expected), str(timeout), token, timeout=timeout + 60)
        assert got == {"status": 200, "available": sorted(expected)}, f"router: {got}\n{self.logs()}"

    def start_engine(self, role: str) -> Proc:
        host = self.cluster.host(role)
        service = self.engine_services[role]
        env = self.env | _environment(service)
        proc = host.start("engine", _command(service), env=env, cwd=self.tmp, log_dir=self.tmp)
        self.engines[role] = proc
        return proc

    def logs(self) -> str:
        parts = []
        for host in self.cluster.hosts:
            for proc in host.procs:
                parts.append(f"----- {proc.name} ({'running' if proc.alive else proc.popen.returncode})\n")
                parts.append(proc.output()[-3000:])
        return "".join(parts)


def _wait(check: Callable[[], bool], what: str, timeout: float, rehearsal: Rehearsal | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = rehearsal.logs() if rehearsal else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)


def _docker(value: Any) -> str:
    """A rendered string as Docker receives it: `config` output escapes `$` as `$$` (valid compose)."""
    return "" if value is None else str(value).replace("$$", "$")


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    return {k: _docker(v) for k, v in (service.get("environment") or {}).items()}


def _command(service: Mapping[str, Any]) -> list[str]:
    return [_docker(a) for a in [*(service.get("entrypoint") or []), *(service.get("command") or [])]]


def _healthy(host: Host, service: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Run the service's rendered healthcheck inside the host, as Docker would."""
    test = [_docker(a) for a in service["healthcheck"]["test"]]
    argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
    return host.run(argv, env={**env, **_environment(service)}, timeout=15).returncode == 0


def _image_commands(bin_dir: Path) -> None:
    """The names the images put on PATH (deploy/docker/*.Dockerfile), pointing at this checkout."""
    for name, script in (("pdgate-engine", "engine_cmd.py"), ("pdgate-healthcheck", "healthcheck.py")):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{DOCKER_DIR / script}" "$@"\n')
        path.chmod(0o755)


@pytest.fixture(scope="module")
def rehearsal() -> Iterator[Rehearsal]:
    for tool in ("redis-server", "redis-cli", "pdgate-metaserver", "pdgate-router", "pdgate-sim"):
        if not (shutil.which(tool) or (VENV_BIN / tool).exists()):
            pytest.fail(f"{tool} is needed for the rehearsal")
    head_env = read_env_file(ENV_FILES["head"])
    head_config = render(ENV_FILES["head"], {"PDGATE_HEAD_ADDR": HEAD_ADDR})
    head_services = {name: head_config["services"][name] for name in ("redis", "metaserver", "router")}
    for name, svc in head_services.items():
        for _, published, target in published_ports(svc):
            # The rehearsal runs each service on its container port; the shipped files publish 1:1.
            assert published == target, f"{name}: published {published} != container port {target}"
    engine_services: dict[str, dict[str, Any]] = {}
    for host_role, role, octet in ENGINE_HOSTS:
        assert read_env_file(ENV_FILES[role])["COMPOSE_PROFILES"].startswith(f"{role}-")
        config = render(ENV_FILES[role], {"PDGATE_HEAD_ADDR": HEAD_ADDR, "PDGATE_HOST_ADDR": f"10.77.0.{octet}"})
        engine_services[host_role] = config["services"][f"{role}-sim"]

    cluster = Cluster([("head", 1), *((h, o) for h, _, o in ENGINE_HOSTS)])
    tmp = Path(tempfile.mkdtemp(prefix="pdgate-rehearsal-"))
    try:
        cluster.start()
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        _image_commands(bin_dir)
        env = {
            "PATH": os.pathsep.join([str(bin_dir), str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin"]),
            "HOME": str(tmp),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        # Compose's DNS on the head's bridge network: every service name is the head itself.
        cluster.hosts_file(cluster.head, dict.fromkeys(head_services, "127.0.0.1"))
        rehearsal = Rehearsal(
            cluster=cluster,
            tmp=tmp,
            env=env,
            head_services=head_services,
            engine_services=engine_services,
            engines={},
            lease_s=float(head_env["PDGATE_INSTANCE_LEASE_S"]),
        )
        # The head, in compose's dependency order, each gated on its dependency's healthcheck.
        for name in ("redis", "metaserver", "router"):
            svc = head_services[name]
            data = tmp / name  # the container's working directory (redis: its AOF)
            data.mkdir()
            cluster.head.start(name, _command(svc), env=env | _environment(svc), cwd=data, log_dir=tmp)
            if name != "router":  # the router is healthy only once a pair has registered
                _wait(lambda s=svc: _healthy(cluster.head, s, env), f"{name} healthy", 30, rehearsal)
        for host_role, _, _ in ENGINE_HOSTS:
            rehearsal.start_engine(host_role)
        yield rehearsal
    finally:
        cluster.close()
        leftovers = cluster.leftovers()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not leftovers, f"namespaces left behind: {leftovers}"


def _expected_ids(r: Rehearsal) -> dict[str, str]:
    out = {}
    for host_role, role, octet in ENGINE_HOSTS:
        port = r.engine_services[host_role]["environment"]["PDGATE_ENGINE_PORT"]
        out[host_role] = f"{role}-10.77.0.{octet}-{port}"
    return out


def test_engine_hosts_reach_the_head_only_through_the_bridge(rehearsal: Rehearsal) -> None:
    """Each engine host sees the metaserver at the head's address, and the namespaces are isolated."""
    env = rehearsal.env
    for host in rehearsal.cluster.hosts[1:]:
        probe = host.run(["pdgate-healthcheck", f"http://{HEAD_ADDR}:8300/health"], env=env)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        # The head's loopback is not the engine host's: nothing listens on 8300 there.
        local = host.run(["pdgate-healthcheck", "http://127.0.0.1:8300/health", "--timeout", "1"], env=env)
        assert local.returncode == 1


def test_engines_register_themselves_with_their_advertised_addresses(rehearsal: Rehearsal) -> None:
    token = rehearsal.head_services["metaserver"]["environment"]["PDGATE_METASERVER_ADMIN_TOKEN"]
    expected = sorted(_expected_ids(rehearsal).values())
    got = rehearsal.client("wait-instances", token, json.dumps(expected), "60", timeout=120)
    assert got == expected, f"registry: {got}\n{rehearsal.logs()}"
    for host_role, instance_id in _expected_ids(rehearsal).items():
        record = rehearsal.client("instance", token, instance_id)
        e = rehearsal.engine_services[host_role]["environment"]
        assert record["url"] == f"http://{e['PDGATE_ENGINE_ADVERTISE_ADDR']}:{e['PDGATE_ENGINE_PORT']}"
        assert record["model"] == e["PDGATE_ENGINE_SERVED_MODEL_NAME"]
        assert record["block_size"] == int(e["PDGATE_ENGINE_BLOCK_SIZE"])
        assert record["role"] == e["PDGATE_ENGINE_ROLE"]
    rehearsal.wait_router(expected, 60)


def _engine_urls(r: Rehearsal, roles: tuple[str, ...]) -> list[str]:
    urls = []
    for host_role in roles:
        e = r.engine_services[host_role]["environment"]
        urls.append(f"http://{e['PDGATE_ENGINE_ADVERTISE_ADDR']}:{e['PDGATE_ENGINE_PORT']}")
    return urls


def _send(r: Rehearsal, n: int, tag: str) -> None:
    model = r.engine_services["prefill-a"]["environment"]["PDGATE_ENGINE_SERVED_MODEL_NAME"]
    result = r.client("complete", model, str(n), tag)
    assert result == {"answered": n, "streamed": True}, result


def test_requests_from_the_head_reach_every_engine_host(rehearsal: Rehearsal) -> None:
    hosts = ("prefill-a", "prefill-b", "decode-a")
    urls = _engine_urls(rehearsal, hosts)
    before = rehearsal.client("sim-counts", *urls)
    n = 16
    _send(rehearsal, n, "reach")
    after = rehearsal.client("sim-counts", *urls)
    served = {host: after[url] - before[url] for host, url in zip(hosts, urls, strict=True)}
    # Every request (and the streamed one) went through one prefill host and the decode host.
    assert served["prefill-a"] + served["prefill-b"] == n + 1, served
    assert served["decode-a"] == n + 1, served
    assert served["prefill-a"] > 0 and served["prefill-b"] > 0, served


def test_a_stopped_host_leaves_the_rotation_within_its_lease_and_rejoins_when_started(rehearsal: Rehearsal) -> None:
    token = rehearsal.head_services["metaserver"]["environment"]["PDGATE_METASERVER_ADMIN_TOKEN"]
    ids = _expected_ids(rehearsal)
    record = rehearsal.client("instance", token, ids["prefill-b"])
    assert record is not None
    lease_s = float(record["lease_s"])
    # A watcher in the head polls the record from before the loss until it is gone.
    watcher = rehearsal.head.start(
        "watch", [sys.executable, "-m", "tests.deploy.head_client", "watch-gone", token, ids["prefill-b"],
                  str(lease_s + 30)], env=rehearsal.env, cwd=rehearsal.tmp, log_dir=rehearsal.tmp,
    )  # fmt: skip
    _wait(lambda: '"watching": true' in watcher.output(), "watcher started", 60, rehearsal)
    # The host "loses power": every process in its namespace is killed, nothing deregisters.
    killed_at = time.time()
    rehearsal.cluster.host("prefill-b").kill_all()
    _wait(lambda: not watcher.alive, "watcher finished", lease_s + 60, rehearsal)
    gone_at = json.loads(watcher.output().strip().splitlines()[-1])["gone_at"]
    assert gone_at is not None, f"prefill-b still registered {lease_s + 30:.0f} s after its host died"
    # Its last heartbeat was at most one lease before the loss, so the record lapses within a lease of
    # the loss (plus the sweeper's step and the watcher's poll).
    assert gone_at - killed_at <= lease_s + 2.0, (gone_at - killed_at, lease_s)

    remaining = sorted(v for k, v in ids.items() if k != "prefill-b")
    rehearsal.wait_router(remaining, 10)
    urls = _engine_urls(rehearsal, ("prefill-a", "decode-a"))
    before = rehearsal.client("sim-counts", *urls)
    _send(rehearsal, 8, "after-loss")
    after = rehearsal.client("sim-counts", *urls)
    assert [after[u] - before[u] for u in urls] == [9, 9]

    # Adding a host is starting it: the same command, nothing changes on the head.
    rehearsal.start_engine("prefill-b")
    rehearsal.wait_router(sorted(ids.values()), 30)
    (url_b,) = _engine_urls(rehearsal, ("prefill-b",))
    _send(rehearsal, 16, "rejoin")
    assert rehearsal.client("sim-counts", url_b)[url_b] > 0


def test_namespaces_and_processes_are_cleaned_up_even_after_a_failure(tmp_path: Path) -> None:
    broken = Cluster([("head", 1), ("twin", 11), ("twin", 12)])  # the second "twin" cannot be created
    with pytest.raises(NetnsError):
        broken.start()
    assert broken.leftovers() == []

    cluster = Cluster([("head", 1), ("engine", 11)]).start()
    try:
        cluster.hosts_file(cluster.head, {"metaserver": "127.0.0.1"})
        sleeper = cluster.host("engine").start(
            "sleep", ["sleep", "600"], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, log_dir=tmp_path
        )
        assert sleeper.alive
    finally:
        cluster.close()
    assert not sleeper.alive
    assert cluster.leftovers() == []

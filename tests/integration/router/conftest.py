"""Real deployments for the router's integration tests: pdgate-sim subprocesses and a router over sockets.

`Sim` is one `pdgate-sim` process (its CLI, on a free loopback port); tests change its faults with
`sim.script(...)` and read its counters with `sim.stats()`. `Deployment` is a router (in a uvicorn
thread with the router's own HTTP protocol, built from settings, running the embedded metaserver unless
told otherwise) plus sims that register with it. Readiness is always polled, never slept for.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pdgate.metaserver.settings import MetaSettings
from pdgate.router.app import RouterApp, create_app, serving_protocol
from pdgate.router.settings import RouterSettings

from tests.support.ports import free_port, wait_until
from tests.support.servers import UvicornThread, wait_http

_LOGS = Path(tempfile.mkdtemp(prefix="pdgate-router-tests-"))
HTTP = httpx.Client(timeout=10)  # one keep-alive client for the tests' control calls


class Sim:
    """One pdgate-sim process."""

    def __init__(self, role: str, *args: str, metaserver: str | None = None, name: str | None = None) -> None:
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdgate.sim", "--role", role, "--port", str(self.port), *args]
        if metaserver:
            cmd += ["--metaserver", metaserver]
        if name:
            cmd += ["--instance-id", name]
        self.id = name or f"127.0.0.1-{self.port}"
        self.log_path = _LOGS / f"sim-{role}-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self) -> Sim:
        try:
            wait_http(self.url + "/v1/models", timeout=30)
        except TimeoutError as exc:
            raise RuntimeError(f"sim on {self.url} did not start: {self.log_path.read_text()[-2000:]}") from exc
        return self

    def script(self, **changes: Any) -> dict[str, Any]:
        resp = HTTP.post(self.url + "/sim/script", json=changes)
        resp.raise_for_status()
        return dict(resp.json())

    def stats(self, log: bool = False) -> dict[str, Any]:
        resp = HTTP.get(self.url + "/sim/stats" + ("?log=1" if log else ""))
        resp.raise_for_status()
        return dict(resp.json())

    def count(self, key: str) -> int:
        return int(self.stats()["counts"].get(key, 0))

    def reset(self) -> None:
        HTTP.post(self.url + "/sim/reset").raise_for_status()
        self.script(
            prefill_delay=0.0,
            token_delay=0.0,
            decode_delay=0.0,
            fail_first=0,
            fail_status=503,
            fail_rate=0.0,
            die_after_tokens=None,
            hang=False,
            no_kv_params=False,
            unhealthy=False,
            hold_until=0,
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_sims(specs: Sequence[tuple[str, Sequence[str]]], metaserver: str | None = None) -> list[Sim]:
    """Start several sims at once (their start-ups overlap), then wait for each."""
    sims = [Sim(role, *args, metaserver=metaserver) for role, args in specs]
    for sim in sims:
        sim.wait()
    return sims


class Deployment:
    """A router (embedded metaserver unless `metaserver` is given) and its sims."""

    def __init__(self, meta_settings: MetaSettings | None = None, **settings: Any) -> None:
        port = free_port()
        defaults: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": port,
            "refresh_interval_s": 0.1,
            "health_interval_s": 0.2,
            "retry_backoff_s": 0.0,
            "log_level": "warning",
        }
        self.settings = RouterSettings(**{**defaults, **settings})
        self.app: RouterApp = create_app(self.settings, meta_settings=meta_settings)
        # The router's own HTTP protocol, as `pdgate-router` serves: one write per answer, disconnect hooks.
        self.server = UvicornThread(self.app, port=port, http=serving_protocol(self.settings))
        self.url = self.server.url
        self.sims: list[Sim] = []

    def start(self) -> Deployment:
        self.server.start()
        return self

    def add(self, role: str, *args: str, register: bool = True) -> Sim:
        return self.add_many([(role, args)], register=register)[0]

    def add_many(self, specs: Sequence[tuple[str, Sequence[str]]], register: bool = True) -> list[Sim]:
        meta = (self.settings.metaserver or self.url) if register else None
        token = ["--admin-token", self.settings.admin_token] if register and self.settings.admin_token else []
        sims = start_sims([(role, [*args, *token]) for role, args in specs], metaserver=meta)
        self.sims += sims
        return sims

    def by_role(self, role: str) -> list[Sim]:
        return [s for s in self.sims if s.role == role]

    def reset_sims(self) -> None:
        """Each sim's script and counters back to its start (a module's autouse fixture, between tests)."""
        for sim in self.sims:
            sim.reset()

    def health(self) -> dict[str, Any]:
        """The admin's /health (instance ids: an anonymous caller reads opaque names), as the tests wait on it."""
        token = self.settings.admin_token or self.settings.metaserver_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return dict(HTTP.get(self.url + "/health", headers=headers).json())

    def wait_available(self, *ids: str, available: bool = True) -> None:
        """Poll the router's /health until each instance id is (un)available to it."""

        def check() -> bool:
            seen = {i["id"]: i["available"] for i in self.health()["instances"]}
            return all(seen.get(i) is available for i in ids)

        wait_until(check, timeout=20, what=f"instances {ids} available={available} in the router")

    def wait_gone(self, *ids: str) -> None:
        wait_until(
            lambda: not ({i["id"] for i in self.health()["instances"]} & set(ids)),
            timeout=20,
            what=f"instances {ids} gone from the router",
        )

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def async_openai(self, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self) -> None:
        self.server.stop()
        for sim in self.sims:
            sim.stop()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def transfer_ids(sim: Sim, mode: str) -> list[str]:
    return [e["transfer_id"] for e in sim.stats(log=True)["log"] if e["mode"] == mode]


@pytest.fixture(scope="session")
def fd_limit() -> None:
    """Concurrency tests hold thousands of sockets: raise the soft descriptor limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

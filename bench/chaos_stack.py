"""The chaos suite's stack: Redis, a metaserver, routers and `pdgate-sim` engines, each a real process.

Processes start through the console scripts of the venv that runs this file (`pdgate-metaserver`,
`pdgate-router`, `pdgate-sim`), so the suite follows the commands users run, wherever the modules behind
them live. Redis starts through the project's own `tests.support.redis.RedisServer`.

Every process goes into `Procs`, which kills each by its PID (and its process group) on `close()`; the
orchestrator calls it from `finally`, from an `atexit` hook and on SIGTERM, so nothing outlives a run,
including one stopped with Ctrl-C.

Leases and timeouts are short on purpose (see `Timing`): the suite measures recovery, and recovery can
only be as fast as the slowest lease. They are written into the results, next to the numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402
from tests.support.redis import RedisServer  # noqa: E402

__all__ = ["BIN", "Proc", "Procs", "Stack", "Timing", "metric_by_label"]

BIN = Path(sys.executable).parent
TOKEN = "chaos-admin"
SIM_ENV = {"PDGATE_SIM_ADMIN_TOKEN": TOKEN, "PDGATE_SIM_METASERVER_TOKEN": TOKEN}


@dataclass(frozen=True)
class Timing:
    """Leases and timeouts of the chaos stack (seconds)."""

    instance_lease_s: float = 3.0
    pending_lease_s: float = 8.0
    ready_lease_s: float = 4.0
    claim_lease_s: float = 2.0
    max_claims: int = 2
    sweep_interval_s: float = 0.1
    metaserver_timeout_s: float = 1.0
    decode_timeout_s: float = 4.0
    prefill_timeout_s: float = 4.0
    stream_idle_timeout_s: float = 2.0
    health_interval_s: float = 0.5
    breaker_open_s: float = 2.0
    refresh_interval_s: float = 0.5
    claim_wait_s: float = 6.0
    token_delay_s: float = 0.04

    def handoff_horizon(self) -> float:
        """Longest a handoff may stay live: PENDING, then READY and every lapsed claim, plus one sweep."""
        return (
            self.pending_lease_s
            + self.ready_lease_s
            + self.max_claims * (self.claim_lease_s + self.ready_lease_s)
            + self.sweep_interval_s
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process cannot die of SIGTERM
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Procs:
    """Every process a run started, killed by PID at the end (also on Ctrl-C, SIGTERM or an exception)."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdgate-chaos-"))
        self.procs: list[Proc] = []
        self.redis: list[RedisServer] = []
        self.started: list[int] = []  # every PID this run started, for the check that none outlives it
        atexit.register(self.close)

    def start(
        self, name: str, argv: Sequence[str], *, url: str = "", port: int = 0, env: dict[str, str] | None = None
    ) -> Proc:
        log = self.log_dir / f"{name}-{len(self.procs)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: a signal reaches its children too
                env={**os.environ, **(env or {})},
            )
        proc = Proc(name, list(argv), popen, log, url, port)
        self.procs.append(proc)
        self.started.append(popen.pid)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
        self.procs.clear()
        for server in self.redis:
            if server.pid is not None:
                self.started.append(server.pid)
            with contextlib.suppress(Exception):
                server.close()
        self.redis.clear()


def wait_ready(url: str, *, timeout: float = 30.0, proc: Proc | None = None, path: str = "/health") -> None:
    """Poll `url + path` until it answers 2xx; fail early when `proc` died."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: {proc.tail()}")
        try:
            r = httpx.get(url + path, timeout=1.0)
            if r.status_code < 300:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not ready within {timeout} s (last: {last!r})")


@dataclass
class Stack:
    """One chaos stack; `start()` brings it up, `procs.close()` takes every process down."""

    procs: Procs
    timing: Timing = field(default_factory=Timing)
    routers_n: int = 1
    aof: bool = False
    redis: RedisServer | None = None
    metaserver: Proc | None = None
    routers: list[Proc] = field(default_factory=list)
    prefills: list[Proc] = field(default_factory=list)
    decodes: list[Proc] = field(default_factory=list)
    meta_port: int = 0
    # Where a component runs: name -> (argv prefix, listen address). Default: this host, loopback.
    # The partition scenario puts components into network namespaces with it.
    place: Callable[[str], tuple[list[str], str]] | None = None
    redis_args: list[str] = field(default_factory=list)

    def where(self, name: str) -> tuple[list[str], str]:
        return self.place(name) if self.place is not None else ([], "127.0.0.1")

    @property
    def meta_url(self) -> str:
        return f"http://{self.where('metaserver')[1]}:{self.meta_port}"

    def start(self) -> Stack:
        extra = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.aof else []
        self.redis = RedisServer(extra_args=[*extra, *self.redis_args]).start()
        self.procs.redis.append(self.redis)
        self.meta_port = free_port()
        self.metaserver = self.start_metaserver()
        wait_ready(self.meta_url, proc=self.metaserver)
        for i in range(2):
            self.prefills.append(self.start_sim("prefill", f"p{i}"))
            self.decodes.append(self.start_sim("decode", f"d{i}"))
        for _ in range(self.routers_n):
            self.routers.append(self.start_router())
        for p in [*self.prefills, *self.decodes]:
            wait_ready(p.url, proc=p)
        for r in self.routers:
            wait_ready(r.url, proc=r)  # 200 only once a prefill and a decode are registered and healthy
        return self

    def start_metaserver(self) -> Proc:
        t = self.timing
        assert self.redis is not None
        redis_url = self.redis.url.replace("127.0.0.1", self.where("redis")[1])
        flags = [
            "--store", f"{redis_url}?prefix=chaos",
            "--instance-lease-s", str(t.instance_lease_s),
            "--pending-lease-s", str(t.pending_lease_s),
            "--ready-lease-s", str(t.ready_lease_s),
            "--claim-lease-s", str(t.claim_lease_s),
            "--max-claims", str(t.max_claims),
            "--sweep-interval-s", str(t.sweep_interval_s),
            "--log-level", "warning",
        ]  # fmt: skip
        env = {"PDGATE_ADMIN_TOKEN": TOKEN}  # secrets through the environment, never argv
        return self._serve("metaserver", "metaserver", "pdgate-metaserver", self.meta_port, flags, env)

    def start_router(self, port: int | None = None) -> Proc:
        t = self.timing
        flags = [
            "--metaserver", self.meta_url,
            "--metaserver-timeout-s", str(t.metaserver_timeout_s),
            "--refresh-interval-s", str(t.refresh_interval_s),
            "--decode-timeout-s", str(t.decode_timeout_s),
            "--prefill-timeout-s", str(t.prefill_timeout_s),
            "--stream-idle-timeout-s", str(t.stream_idle_timeout_s),
            "--health-interval-s", str(t.health_interval_s),
            "--breaker-open-s", str(t.breaker_open_s),
            "--max-inflight", "8192",
            "--log-level", "warning",
        ]  # fmt: skip
        env = {"PDGATE_ROUTER_METASERVER_TOKEN": TOKEN}
        return self._serve("router", "router", "pdgate-router", port or free_port(), flags, env)

    def start_sim(self, role: str, iid: str, port: int | None = None) -> Proc:
        t = self.timing
        flags = [
            "--role", role,
            "--instance-id", iid,
            "--metaserver", self.meta_url,
            "--metaserver-timeout-s", str(t.metaserver_timeout_s),
            "--lease-s", str(t.instance_lease_s),
            "--claim-wait-s", str(t.claim_wait_s),
            "--claim-lease-s", str(t.claim_lease_s),
            "--token-delay", str(t.token_delay_s),
            # Token ids both ways, as vLLM answers return_token_ids: what lets the router resume a broken
            # stream on another instance (router/resume.py) instead of ending it with an error.
            "--token-ids",
        ]  # fmt: skip
        return self._serve(f"sim-{iid}", iid, "pdgate-sim", port or free_port(), flags, SIM_ENV)

    def _serve(self, name: str, place: str, binary: str, port: int, flags: list[str], env: dict[str, str]) -> Proc:
        """One pdgate server where `place` puts it (this host, or a network namespace), on `port`."""
        prefix, host = self.where(place)
        argv = [*prefix, str(BIN / binary), "--host", host, "--port", str(port), *flags]
        return self.procs.start(name, argv, url=f"http://{host}:{port}", port=port, env=env)

    @property
    def sims(self) -> list[Proc]:
        return [*self.prefills, *self.decodes]


# -- what the stack reports ----------------------------------------------------------------------


def metric_by_label(url: str, metric: str, label: str) -> dict[str, float] | None:
    """One metric from `url`'s /metrics, summed per value of `label` ("" where a sample lacks it); None when
    the server cannot answer, which a fault scenario must tell apart from an empty count."""
    try:
        text = httpx.get(url + "/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    key = f'{label}="'
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            value = line.split(key, 1)[1].split('"', 1)[0] if key in line else ""
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def handoff_gauge(meta_url: str) -> dict[str, float] | None:
    """Live handoffs by state, from the metaserver's /metrics (None when it cannot answer)."""
    return metric_by_label(meta_url, "pdgate_metaserver_handoffs", "state")


def sim_stats(url: str, *, log: bool = False) -> dict[str, Any] | None:
    try:
        r = httpx.get(url + "/sim/stats" + ("?log=1" if log else ""), timeout=3.0)
        return dict(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def held_blocks(stack: Stack) -> dict[str, Any]:
    """Prefill blocks still held, per live prefill (from GET /sim/stats `held_blocks`)."""
    out: dict[str, Any] = {}
    for p in stack.prefills:
        if not p.alive:
            continue
        st = sim_stats(p.url)
        out[p.name] = None if st is None else st.get("held_blocks")
    return out

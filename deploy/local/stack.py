"""LocalStack: the router (with its embedded metaserver, or a Redis store), N prefill and M decode vLLM
engines joined by PDGateConnector over NIXL, all on this machine.

The launcher (`pdgate-local up`), the end-to-end tests and `bench/e2e.py` start the stack through this
one class, so what the tests prove is what a newcomer runs. Start-up is the expensive part (45-75 s
per vLLM engine on two cores), so the class also lets a caller add an instance to a running stack
(`add_instance`) instead of starting a new one: instances register themselves with the metaserver and
the router pairs them as soon as they appear.

Before the stack says it is ready, each engine answers one request with `logprobs` (`warm_up`): vLLM
compiles its logprobs kernel (`batched_count_greater_than`, `torch.compile` with inductor, in
vllm/v1/sample/ops/logprobs.py) at its first use in each engine process, which took 52.5 s on 2 cores
(issue #26), long enough for a decode's claim lease to lapse mid-request. `--enforce-eager` does not
cover it. The warm-up moves that cost into start-up, where it is said and timed.

`SingleInstance` (single.py) is one plain vLLM engine with the same serving flags and no connector: the
baseline that PD outputs are compared against.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pdgate.deploy.local import kv_events
from pdgate.deploy.local.model import DEFAULT_MODEL_DIR, Log, StackError, ensure_model, served_model_name
from pdgate.deploy.local.procs import ManagedProcess, ProcessFailed, free_port, port_is_free, stop_all, wait_http
from pdgate.deploy.local.single import SingleInstance, http_get_json
from pdgate.deploy.local.vllm_env import VllmEnv, ensure_vllm_env, repo_root
from pdgate.deploy.local.vllm_instance import ServeFlags, VllmInstanceSpec, start_engine, write_logging_config

__all__ = [
    "DEFAULT_MODEL_DIR",
    "InstanceHandle",
    "LocalStack",
    "SingleInstance",
    "StackConfig",
    "StackError",
    "ensure_model",
]

ADMIN_TOKEN_ENV = "PDGATE_ROUTER_ADMIN_TOKEN"  # the router's admin token (its embedded metaserver's)
ENGINE_TOKEN_ENV = "PDGATE_CONNECTOR_METASERVER_TOKEN"  # what PDGateConnector sends to the metaserver
CONNECTOR_CLASS = "PDGateConnector"
CONNECTOR_MODULE = "pdgate.connector"


def host_cpus() -> list[int]:
    """The CPUs this process may run on, in order: what engines are pinned to, one each."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def wait_healthy(
    engines: Sequence[InstanceHandle], timeout_s: float, log: Log, others: Sequence[ManagedProcess]
) -> None:
    """Until each engine answers GET /health; fail fast, naming the process, when any of `others` exits."""
    for e in engines:
        waited = wait_http(e.proc, e.url + "/health", timeout_s=timeout_s, others=list(others))
        log(f"{e.instance_id}: healthy after {waited:.0f} s")


def wait_router_ready(router: ManagedProcess, url: str, log: Log, others: Sequence[ManagedProcess]) -> None:
    """Until the router at `url` reports a compatible prefill/decode pair (its /health answers 200)."""
    waited = wait_http(router, url + "/health", timeout_s=60, what="ready (a compatible pair)", others=list(others))
    log(f"router: ready on {url} after {waited:.1f} s")


@dataclass(frozen=True)
class StackConfig:
    """What to start. Every field has a default that runs on a 2-core laptop."""

    n_prefill: int = 1
    n_decode: int = 1
    port: int = 8000
    store: str | None = None  # None: the router's embedded metaserver; else e.g. redis://127.0.0.1:6379/0
    model_dir: Path = DEFAULT_MODEL_DIR
    run_dir: Path | None = None  # logs and pid files; a fresh temporary folder when None
    venv: Path | None = None
    install: bool = True  # create the vLLM venv when it is missing
    block_size: int = 32
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    transport: str = "nixl"
    # Extra kv_connector_extra_config keys for every instance, and per role (tests use these for
    # test-only options such as corrupting pulled bytes).
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    prefill_extra: Mapping[str, Any] = field(default_factory=dict)
    decode_extra: Mapping[str, Any] = field(default_factory=dict)
    router_args: Sequence[str] = ()
    router_env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    host: str = "127.0.0.1"  # the router's listen address (the engines stay on loopback)
    served_name: str | None = None  # None: `model.served_model_name` (tiny: pdgate-tiny; else the folder's)
    # vLLM's own arguments, after pdgate's (vLLM takes the last of a repeated flag): every engine's, then
    # one role's. E.g. ("--max-model-len", "8192") or ("--dtype", "float32").
    engine_args: Sequence[str] = ()
    prefill_args: Sequence[str] = ()
    decode_args: Sequence[str] = ()
    warm_up: bool = True  # one logprobs request per engine before ready (see the module docstring)
    # The engines publish their KV events and the router follows them (deploy/local/kv_events.py); add
    # `--prefill-policy cache_aware` (and the decode's) to `router_args` to route by them.
    kv_events: bool = False

    @property
    def model_name(self) -> str:
        return served_model_name(Path(self.model_dir), self.served_name)

    def flags(self) -> ServeFlags:
        return ServeFlags(
            model_dir=Path(self.model_dir),
            served_name=self.model_name,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
        )

    def role_args(self, role: str) -> tuple[str, ...]:
        """The vLLM arguments appended to one engine's command line: every engine's, then its role's."""
        return (*self.engine_args, *(self.prefill_args if role == "prefill" else self.decode_args))


@dataclass
class InstanceHandle:
    """A running vLLM engine of the stack."""

    role: str  # "prefill" | "decode"
    instance_id: str
    spec: VllmInstanceSpec
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    @property
    def stats_path(self) -> Path:
        """The connector's counters (its `stats_file`), rewritten by the engine as they change."""
        return self.proc.log_path.with_suffix(".stats.json")

    def read_stats(self) -> dict[str, Any]:
        """The connector's last written counters ({} before the first write)."""
        try:
            data: dict[str, Any] = json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}
        return data


class LocalStack:
    """Start/stop the whole local PD stack; usable as a context manager."""

    def __init__(self, config: StackConfig | None = None, *, log: Log = print) -> None:
        self.config = config or StackConfig()
        self.log = log
        self.run_dir = Path(self.config.run_dir or tempfile.mkdtemp(prefix="pdgate-local-")).resolve()
        self.router: ManagedProcess | None = None
        self.instances: list[InstanceHandle] = []
        self.env: VllmEnv | None = None
        self.timings: dict[str, float] = {}
        self._counters = {"prefill": 0, "decode": 0}
        cfg = self.config
        self.kv_event_ports = kv_events.plan(cfg.n_prefill, cfg.n_decode) if cfg.kv_events else {}
        self._cpu_cursor = 0
        # The admin token of the router's metaserver: generated per stack, handed to the router and the
        # engines in their environment (never argv, where `ps` shows it to every user of the host).
        # An operator's own token (the config's, else the launcher's environment) wins over a fresh one.
        self.admin_token = (
            self.config.router_env.get(ADMIN_TOKEN_ENV) or os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(32)
        )

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers for the metaserver's /v1 routes (registry and ledger)."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    def router_env(self) -> dict[str, str]:
        """The router's environment: ours, the config's additions, and the admin token."""
        env = dict(os.environ)
        env.update(self.config.router_env)
        env[ADMIN_TOKEN_ENV] = self.admin_token
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def engine_env(self, spec: VllmInstanceSpec, flags: ServeFlags) -> dict[str, str]:
        """An engine's environment: vLLM's, plus the token its connector sends to the metaserver."""
        env = spec.env(repo_root(), flags, write_logging_config(self.run_dir / "vllm-logging.json"))
        env[ENGINE_TOKEN_ENV] = self.admin_token
        return env

    # -- addresses --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The router: the OpenAI-compatible front door, as this host reaches it."""
        return f"http://{connect_host(self.config.host)}:{self.config.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    @property
    def metaserver_url(self) -> str:
        """Where instances register and the ledger lives (the router itself, metaserver embedded)."""
        return self.url

    def by_role(self, role: str) -> list[InstanceHandle]:
        return [i for i in self.instances if i.role == role]

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalStack:
        """Start everything and return once the router can serve a PD request."""
        cfg = self.config
        if cfg.n_prefill < 1 or cfg.n_decode < 1:
            raise StackError("a PD stack needs at least one prefill and one decode instance")
        if not port_is_free(cfg.port, connect_host(cfg.host)):
            raise StackError(f"port {cfg.port} is already in use on {cfg.host}: pick another one (--port)")
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"run dir: {self.run_dir} (logs of every process)")
        try:
            self.env = ensure_vllm_env(cfg.venv, install=cfg.install, log=self.log)
            self.timings["venv_s"] = time.monotonic() - t0
            t = time.monotonic()
            ensure_model(Path(cfg.model_dir), self.env, self.log)
            self.timings["model_s"] = time.monotonic() - t
            t = time.monotonic()
            self._start_router()
            new = [self._launch("prefill") for _ in range(cfg.n_prefill)]
            new += [self._launch("decode") for _ in range(cfg.n_decode)]
            self._wait_instances(new)
            self.wait_router_ready()
            self.timings["engines_s"] = time.monotonic() - t
            t = time.monotonic()
            self.warm_up(self.instances)
            self.timings["warm_up_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        self.log(f"stack ready in {self.timings['start_s']:.0f} s: {self.url}/v1 serves {cfg.model_name}")
        return self

    def add_instance(self, role: str, *, extra: Mapping[str, Any] | None = None) -> InstanceHandle:
        """Start one more engine in the running stack and wait until the router knows it."""
        handle = self._launch(role, extra=extra)
        try:
            self._wait_instances([handle])
            self.warm_up([handle])
        except BaseException:
            handle.proc.stop()
            self.instances.remove(handle)
            raise
        return handle

    def remove_instance(self, handle: InstanceHandle) -> None:
        """Stop one engine and take it out of the registry at once (not after its lease lapses)."""
        handle.proc.stop()
        with contextlib.suppress(ValueError):
            self.instances.remove(handle)
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=5.0, trust_env=False) as client:
            client.delete(f"{self.metaserver_url}/v1/instances/{handle.instance_id}")
        self.log(f"{handle.instance_id}: stopped and deregistered")

    def stop(self) -> None:
        procs = [i.proc for i in self.instances]
        if self.router is not None:
            procs.append(self.router)
        if procs:
            self.log(f"stopping {len(procs)} processes")
            stop_all(procs)
        self.instances = []
        self.router = None

    # -- pieces -----------------------------------------------------------------------------

    def _next_cpu(self) -> str:
        cpus = host_cpus()
        if max(self.config.n_prefill + self.config.n_decode, self._cpu_cursor + 1) > len(cpus):
            # More engines than cores: two engines pinned to one core starve each other. Measured on a
            # 2-core host (1P2D, docs/NIXL.md): while the prefill held KV it stepped without pause and its
            # worker busy-waited (vLLM's shm queue spins sched_yield); decode-1, pinned to the same core,
            # got no CPU time at all for ~40 s, until the handoffs' READY lease expired. Unpinned, the
            # kernel moves a starved thread to the other core.
            return "nobind"
        cpu = cpus[self._cpu_cursor % len(cpus)]
        self._cpu_cursor += 1
        return str(cpu)

    def _start_router(self) -> None:
        cfg = self.config
        argv = [sys.executable, "-m", "pdgate.router", *router_args(cfg), *kv_events.router_args(self.kv_event_ports)]
        env = self.router_env()
        self.router = ManagedProcess(
            "router", argv, log_path=self.run_dir / "router.log", env=env, cwd=repo_root()
        ).start()
        self.log(f"router: starting on {self.url} (log {self.router.log_path})")
        waited = wait_http(
            self.router, self.url + "/v1/instances", timeout_s=60, what="listening", headers=self.admin_headers
        )
        self.log(f"router: listening after {waited:.1f} s")

    def _launch(self, role: str, *, extra: Mapping[str, Any] | None = None) -> InstanceHandle:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        assert self.env is not None, "start() the stack first"
        cfg = self.config
        index = self._counters[role]
        self._counters[role] += 1
        port = free_port()
        instance_id = f"{role}-{index}"
        log_path = self.run_dir / f"{instance_id}.log"
        stats_path = log_path.with_suffix(".stats.json")
        # A restarted stack reuses its run dir: an earlier engine's counters must not pass for this one's
        # until its first write (a reader would take them as its baseline).
        stats_path.unlink(missing_ok=True)
        events = self.kv_event_ports.get(instance_id)  # the engines the stack started with (kv_events.py)
        spec = engine_spec(
            cfg,
            role,
            instance_id,
            port,
            self._next_cpu(),
            self.metaserver_url,
            stats_path,
            extra=extra or {},
            engine_args=events.engine_args() if events is not None else (),
        )
        flags = cfg.flags()
        proc = start_engine(spec, self.env.python, flags, self.run_dir, env=self.engine_env(spec, flags))
        self.log(f"{instance_id}: starting vLLM on {spec.url}, cpu {spec.cpu} (log {proc.log_path})")
        handle = InstanceHandle(role=role, instance_id=instance_id, spec=spec, proc=proc)
        self.instances.append(handle)
        return handle

    def _wait_instances(self, handles: Sequence[InstanceHandle]) -> None:
        """Wait until each engine answers /health and is in the registry; fail fast on any exit."""
        others = [h.proc for h in handles]
        if self.router is not None:
            others.append(self.router)
        wait_healthy(handles, self.config.startup_timeout_s, self.log, others)
        for h in handles:
            wait_http(
                h.proc,
                f"{self.metaserver_url}/v1/instances/{h.instance_id}",
                timeout_s=60,
                what="registered with the metaserver",
                others=others,
                headers=self.admin_headers,
            )
            self.log(f"{h.instance_id}: registered")

    def warm_up(self, handles: Sequence[InstanceHandle]) -> None:
        """One request with `logprobs` straight to each engine (no KV handoff), all at once, so that vLLM
        compiles its logprobs kernel now and not in a client's first logprobs request (module docstring)."""
        if not self.config.warm_up or not handles:
            return
        self.log("warm-up: one logprobs request per engine (vLLM compiles its logprobs kernel once per process)")
        body = {"model": self.config.model_name, "prompt": "warm up", "max_tokens": 1, "logprobs": 1}

        def one(h: InstanceHandle) -> float:
            t = time.monotonic()
            with httpx.Client(timeout=self.config.startup_timeout_s, trust_env=False) as client:
                resp = client.post(h.url + "/v1/completions", json=body)
            if resp.status_code != 200:
                raise StackError(
                    f"{h.instance_id}: warm-up answered {resp.status_code}: {resp.text[:300]} (log {h.log_path})"
                )
            return time.monotonic() - t

        with ThreadPoolExecutor(len(handles)) as pool:
            took = list(pool.map(one, handles))
        self.log("warm-up: " + ", ".join(f"{h.instance_id} {s:.1f} s" for h, s in zip(handles, took, strict=True)))

    def wait_router_ready(self) -> None:
        """Until the router reports a compatible pair: also how a caller re-checks a stack it kept running."""
        assert self.router is not None
        wait_router_ready(self.router, self.url, self.log, [i.proc for i in self.instances])


def router_args(cfg: StackConfig) -> list[str]:
    """Flags of `pdgate-router` for the local stack (metaserver embedded unless a store is given)."""
    args = ["--host", cfg.host, "--port", str(cfg.port)]
    if cfg.store:
        args += ["--store", cfg.store]
    return args + list(cfg.router_args)


def engine_spec(
    cfg: StackConfig,
    role: str,
    instance_id: str,
    port: int,
    cpu: str,
    metaserver_url: str,
    stats_path: Path,
    *,
    extra: Mapping[str, Any],
    engine_args: Sequence[str] = (),
) -> VllmInstanceSpec:
    """One engine of the stack: its connector config (the config's extras, the role's, `extra`) and the
    user's vLLM arguments (`StackConfig.role_args`; `engine_args` before them), after pdgate's flags on
    its command line."""
    conn_extra: dict[str, Any] = {"stats_file": str(stats_path)}
    conn_extra.update(cfg.connector_extra)
    conn_extra.update(cfg.prefill_extra if role == "prefill" else cfg.decode_extra)
    conn_extra.update(extra)
    return VllmInstanceSpec(
        name=instance_id,
        port=port,
        cpu=cpu,
        extra_args=(*engine_args, *cfg.role_args(role)),
        kv_transfer_config=kv_transfer_config(
            role=role,
            instance_id=instance_id,
            url=f"http://127.0.0.1:{port}",
            metaserver_url=metaserver_url,
            transport=cfg.transport,
            extra=conn_extra,
        ),
    )


def connect_host(host: str) -> str:
    """Where a client on this host reaches a server listening on `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def kv_transfer_config(
    *,
    role: str,
    instance_id: str,
    url: str,
    metaserver_url: str,
    transport: str,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for one engine: PDGateConnector, loaded by module path."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {
            "metaserver_url": metaserver_url,
            "instance_id": instance_id,
            "url": url,
            "transport": transport,
            **extra,
        },
    }


__all__ += [
    "ProcessFailed",
    "connect_host",
    "engine_spec",
    "host_cpus",
    "http_get_json",
    "kv_transfer_config",
    "router_args",
    "served_model_name",
    "start_engine",
    "wait_healthy",
    "wait_router_ready",
]

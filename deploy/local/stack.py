"""LocalStack: the router (with its embedded metaserver, or a Redis store), N prefill and M decode vLLM
engines joined by PDGateConnector over NIXL, all on this machine.

The launcher (`pdgate-local up`), the end-to-end tests and `bench/e2e.py` start the stack through this
one class, so what the tests prove is what a newcomer runs. Start-up is the expensive part (45-75 s
per vLLM engine on two cores), so the class also lets a caller add an instance to a running stack
(`add_instance`) instead of starting a new one: instances register themselves with the metaserver and
the router pairs them as soon as they appear.

`SingleInstance` is one plain vLLM engine with the same serving flags and no connector: the baseline
that PD outputs are compared against.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pdgate.deploy.local.procs import ManagedProcess, ProcessFailed, free_port, port_is_free, stop_all, wait_http
from pdgate.deploy.local.tiny_model import MODEL_NAME, is_built
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
ENGINE_TOKEN_ENV = "PDGATE_METASERVER_TOKEN"  # what PDGateConnector sends to the metaserver
DEFAULT_MODEL_DIR = Path(os.environ.get("PDGATE_MODEL_DIR", "~/.cache/pdgate/pdgate-tiny")).expanduser()
CONNECTOR_CLASS = "PDGateConnector"
CONNECTOR_MODULE = "pdgate.connector"

Log = Callable[[str], None]


class StackError(RuntimeError):
    """The stack could not be started; the message says which part failed and where its log is."""


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


def ensure_model(model_dir: Path, env: VllmEnv, log: Log = print) -> Path:
    """Build the tiny model into `model_dir` unless it is already complete.

    The build needs torch and transformers, which live in the vLLM venv, so it runs there.
    """
    if is_built(model_dir):
        log(f"model: reusing {model_dir}")
        return model_dir
    if (model_dir / "config.json").is_file():  # a checkpoint the user brought: served as it is, never overwritten
        log(f"model: serving the checkpoint in {model_dir} as it is (not built by pdgate; delete it to rebuild)")
        return model_dir
    log(f"model: building {MODEL_NAME} into {model_dir} (offline, a few seconds)")
    out = subprocess.run(
        [str(env.python), "-m", "pdgate.deploy.local.tiny_model", str(model_dir)],
        cwd=str(repo_root()),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0 or not is_built(model_dir):
        raise StackError(f"building the model failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return model_dir


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

    def flags(self) -> ServeFlags:
        return ServeFlags(
            model_dir=Path(self.model_dir),
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
        )


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
        """The router: the OpenAI-compatible front door."""
        return f"http://127.0.0.1:{self.config.port}"

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
        if not port_is_free(cfg.port):
            raise StackError(f"port {cfg.port} is already in use on 127.0.0.1: pick another one (--port)")
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
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        self.log(f"stack ready in {self.timings['start_s']:.0f} s: {self.url}/v1 serves {MODEL_NAME}")
        return self

    def add_instance(self, role: str, *, extra: Mapping[str, Any] | None = None) -> InstanceHandle:
        """Start one more engine in the running stack and wait until the router knows it."""
        handle = self._launch(role, extra=extra)
        try:
            self._wait_instances([handle])
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
        argv = [sys.executable, "-m", "pdgate.router", *router_args(cfg)]
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
        conn_extra: dict[str, Any] = {"stats_file": str(stats_path)}
        conn_extra.update(cfg.connector_extra)
        conn_extra.update(cfg.prefill_extra if role == "prefill" else cfg.decode_extra)
        conn_extra.update(extra or {})
        spec = VllmInstanceSpec(
            name=instance_id,
            port=port,
            cpu=self._next_cpu(),
            kv_transfer_config=kv_transfer_config(
                role=role,
                instance_id=instance_id,
                url=f"http://127.0.0.1:{port}",
                metaserver_url=self.metaserver_url,
                transport=cfg.transport,
                extra=conn_extra,
            ),
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

    def wait_router_ready(self) -> None:
        """Until the router reports a compatible pair: also how a caller re-checks a stack it kept running."""
        assert self.router is not None
        wait_router_ready(self.router, self.url, self.log, [i.proc for i in self.instances])


def router_args(cfg: StackConfig) -> list[str]:
    """Flags of `pdgate-router` for the local stack (metaserver embedded unless a store is given)."""
    args = ["--host", "127.0.0.1", "--port", str(cfg.port)]
    if cfg.store:
        args += ["--store", cfg.store]
    return args + list(cfg.router_args)


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


class SingleInstance:
    """One vLLM engine without a connector: the baseline PD outputs must equal."""

    def __init__(
        self,
        *,
        model_dir: Path = DEFAULT_MODEL_DIR,
        run_dir: Path | None = None,
        venv: Path | None = None,
        install: bool = True,
        port: int | None = None,
        cpu: str | None = None,
        flags: ServeFlags | None = None,
        log: Log = print,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="pdgate-single-")).resolve()
        self.venv = venv
        self.install = install
        self.spec = VllmInstanceSpec(name="single", port=port or free_port(), cpu=cpu)
        self.flags = flags or ServeFlags(model_dir=self.model_dir)
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        self.proc: ManagedProcess | None = None
        self.started_in_s: float | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    def launch(self) -> SingleInstance:
        """Start the process without waiting (so it can boot while something else does)."""
        env = ensure_vllm_env(self.venv, install=self.install, log=self.log)
        ensure_model(self.model_dir, env, self.log)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.proc = start_engine(self.spec, env.python, self.flags, self.run_dir)
        self.log(f"single: starting vLLM on {self.url} (log {self.proc.log_path})")
        return self

    def wait(self) -> SingleInstance:
        assert self.proc is not None, "launch() first"
        self.started_in_s = wait_http(self.proc, self.url + "/health", timeout_s=self.startup_timeout_s)
        self.log(f"single: healthy after {self.started_in_s:.0f} s")
        return self

    def start(self) -> SingleInstance:
        return self.launch().wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def __enter__(self) -> SingleInstance:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_get_json(url: str, timeout: float = 5.0) -> Any:
    """One GET through a client that ignores proxy variables (everything here is loopback)."""
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        resp = client.get(url)
        resp.raise_for_status()
        return resp.json()


__all__ += [
    "ProcessFailed",
    "host_cpus",
    "http_get_json",
    "kv_transfer_config",
    "router_args",
    "start_engine",
    "wait_healthy",
    "wait_router_ready",
]

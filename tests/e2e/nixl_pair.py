"""vLLM's own NixlConnector 1P1D behind pdgate-router: the setup an operator runs before adopting the connector.

Two stock vLLM engines (prefill `kv_producer`, decode `kv_consumer`, `"kv_connector": "NixlConnector"`, no
pdgate code inside vLLM) and `pdgate-router` in front of them with static `--prefill`/`--decode` URLs. The
router's prefill answer carries NIXL's own `kv_transfer_params` (remote engine, blocks, side channel),
which the router forwards verbatim to the decode; NIXL's prefill does not name the router's handoff, so
the router makes no claim (see `router/attempts.py`) and the ledger is not part of the path.

Used by `tests/e2e/test_10_stock_nixl.py` (the router gives the single instance's tokens) and by
`bench/e2e.py` and `bench/e2e_load.py` (the anchor rows). Pinning follows pdgate-local's policy (each
engine's OMP threads bound to its own core, cores taken in order, `LocalStack._next_cpu`); `TUNED`
adds the hand tuning that docs/NIXL.md describes (taskset of the whole engine tree onto its core, and
the engine core and its worker reniced above their own API server). `pinning()` reads back what each process
ended with, from /proc, so a report says what ran rather than what was asked for.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdgate.deploy.local.procs import ManagedProcess, free_port, stop_all
from pdgate.deploy.local.stack import (
    DEFAULT_MODEL_DIR,
    InstanceHandle,
    ensure_model,
    host_cpus,
    start_engine,
    wait_healthy,
    wait_router_ready,
)
from pdgate.deploy.local.vllm_env import ensure_vllm_env, repo_root
from pdgate.deploy.local.vllm_instance import ServeFlags, VllmInstanceSpec

Log = Callable[[str], None]

# A stock engine busy with a long prefill on a shared core can take seconds to answer /health; the
# router's default probe timeout would take it out of the pool mid-run (seen at load average 30 on 2 cores).
ROUTER_ARGS = ("--health-timeout-s", "15")

ENGINE_COMM = "VLLM::"  # /proc/<pid>/comm prefix of vLLM's engine processes (VLLM::EngineCor, VLLM::Worker)


@dataclass(frozen=True)
class Tuning:
    """How the engines are placed beyond pdgate-local's OMP binding."""

    name: str
    taskset: bool = False  # run the whole engine tree (API server, engine core, NIXL threads) on its core
    engine_nice: int | None = None  # renice every thread of the engine core and its worker to this value


AS_SHIPPED = Tuning("as shipped")
TUNED = Tuning("tuned (taskset + renice)", taskset=True, engine_nice=-5)


def nixl_kv_config(role: str) -> dict[str, Any]:
    """vLLM's documented NixlConnector config: producer on the prefill, consumer on the decode
    (vLLM 0.32 deprecates `kv_both` for NixlConnector)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc; children appear after their parent)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(parents.get(p, [])))
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus)) or "-"


def process_pinning(pid: int) -> list[dict[str, Any]]:
    """Per process of the tree under `pid`: its name, the CPU sets its threads may run on, and their nice."""
    rows = []
    for p in _descendants(pid):
        affinities: dict[str, int] = {}
        nices: set[int] = set()
        for tid in _threads(p):
            with contextlib.suppress(OSError):
                key = _cpu_list(os.sched_getaffinity(tid))
                affinities[key] = affinities.get(key, 0) + 1
                nices.add(os.getpriority(os.PRIO_PROCESS, tid))
        if affinities:
            rows.append({"pid": p, "comm": _comm(p), "threads_by_cpus": affinities, "nice": sorted(nices)})
    return rows


def describe_pinning(rows: Sequence[dict[str, Any]]) -> str:
    """One line: `comm[pid] cpus {set: n threads} nice n` per process."""
    parts = []
    for r in rows:
        cpus = " ".join(f"{k}:{n}" for k, n in sorted(r["threads_by_cpus"].items()))
        parts.append(f"{r['comm']}[{r['pid']}] threads on cpus {{{cpus}}} nice {r['nice']}")
    return "; ".join(parts)


@dataclass
class Engine(InstanceHandle):
    """One stock vLLM engine of the pair: a LocalStack engine (url, log) with its NIXL side channel."""

    side_channel_port: int = 0


class LoopbackRouter:
    """A router of the tests' own on a loopback port: its addresses, as a client reaches them."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"


class NixlPair(LoopbackRouter):
    """Start/stop a stock NixlConnector prefill + decode and pdgate-router in front; a context manager."""

    def __init__(
        self,
        *,
        model_dir: Path = DEFAULT_MODEL_DIR,
        run_dir: Path | None = None,
        venv: Path | None = None,
        install: bool = False,
        flags: ServeFlags | None = None,
        tuning: Tuning = AS_SHIPPED,
        port: int | None = None,
        router_args: Sequence[str] = ROUTER_ARGS,
        log: Log = print,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="pdgate-nixl-")).resolve()
        self.venv = venv
        self.install = install
        self.flags = flags or ServeFlags(model_dir=self.model_dir)
        self.tuning = tuning
        self.port = port or free_port()
        self.router_args = list(router_args)
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        self.engines: list[Engine] = []
        self.router: ManagedProcess | None = None

    def engine(self, role: str) -> Engine:
        return next(e for e in self.engines if e.role == role)

    def __enter__(self) -> NixlPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> NixlPair:
        """Both engines boot together; the router starts once they answer /health."""
        try:
            env = ensure_vllm_env(self.venv, install=self.install, log=self.log)
            ensure_model(self.model_dir, env, self.log)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cpus = host_cpus()
            for i, role in enumerate(("prefill", "decode")):
                self.engines.append(self._launch(env.python, role, str(cpus[i % len(cpus)])))
            wait_healthy(self.engines, self.startup_timeout_s, self.log, [e.proc for e in self.engines])
            if self.tuning.engine_nice is not None:
                for e in self.engines:
                    self._renice_engine(e)
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        procs = [e.proc for e in self.engines] + ([self.router] if self.router else [])
        if procs:
            stop_all(procs)
        self.engines = []
        self.router = None

    def pinning(self) -> dict[str, list[dict[str, Any]]]:
        """What each engine's processes ended with (CPU sets per thread, nice), read back from /proc."""
        return {e.role: process_pinning(e.proc.pid) for e in self.engines if e.proc.pid is not None}

    # -- pieces -----------------------------------------------------------------------------

    def _launch(self, python: Path, role: str, cpu: str) -> Engine:
        side = free_port()
        spec = VllmInstanceSpec(
            name=f"nixl-{role}",
            port=free_port(),
            cpu=cpu,  # pdgate-local's policy: the engine's OMP threads on its own core
            kv_transfer_config=nixl_kv_config(role),
            # Two engines on one host need two NIXL side channels; the prefill advertises its own in
            # kv_transfer_params (remote_host/remote_port), so the decode needs no setting of its own.
            extra_env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)},
        )
        wrap = ["taskset", "-c", cpu] if self.tuning.taskset else []
        proc = start_engine(spec, python, self.flags, self.run_dir, wrap=wrap)
        self.log(f"nixl {role}: starting vLLM with NixlConnector on {spec.url}, cpu {cpu}, {self.tuning.name}")
        return Engine(role=role, instance_id=spec.name, spec=spec, proc=proc, side_channel_port=side)

    def _renice_engine(self, e: Engine) -> None:
        """Every thread of the engine core (scheduler, NIXL's handshake and notification threads) and of
        its worker (the model, the NIXL reads) gets `engine_nice`, so on the core it shares with its own
        API server (after taskset) a step runs before HTTP and detokenisation work."""
        nice = self.tuning.engine_nice
        assert nice is not None and e.proc.pid is not None
        cores = [p for p in _descendants(e.proc.pid) if _comm(p).startswith(ENGINE_COMM)]
        if not cores:
            raise RuntimeError(f"nixl {e.role}: no {ENGINE_COMM}* process under pid {e.proc.pid} to renice")
        for p in cores:
            for tid in _threads(p):
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
        self.log(f"nixl {e.role}: engine processes {cores} reniced to {nice}")

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--prefill", self.engine("prefill").url, "--decode", self.engine("decode").url]
        argv += ["--block-size", str(self.flags.block_size), *self.router_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.router = ManagedProcess(
            "nixl-router", argv, log_path=self.run_dir / "nixl-router.log", env=env, cwd=repo_root()
        ).start()
        wait_router_ready(self.router, self.url, self.log, [e.proc for e in self.engines])

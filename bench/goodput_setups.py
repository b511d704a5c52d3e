"""The goodput benchmark's setups. Every one gets the same cores (one engine's OMP threads per core,
`VLLM_CPU_OMP_THREADS_BIND` as pdgate-local pins them, API server and engine core left free: a taskset of
the whole engine tree slowed one replica's TTFT by 10 % and its TPOT by half), the same model and the same
engine flags (`ServeFlags`), and pdgate-router in front. colocated, pd and conditional serve side by side
and take turns (`Serving`); only one of them has load at a time.

- colocated: two connector-less vLLM replicas, each given to the router as `--prefill URL --decode URL`
  (role both) with `--both-path whole`: every request runs end to end on one replica.
- pd: `LocalStack` 1P1D (PDGateConnector over NIXL, the router's embedded metaserver).
- conditional: the same engines, a second router with `--disaggregation conditional` reading the first
  one's registry and ledger (`--metaserver`): the engines the same to the byte.
- nixl: vLLM's stock NixlConnector pair behind pdgate-router (`tests/e2e/nixl_pair.py`, as shipped).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput_plan import HEARTBEAT_S
from pdgate.deploy.local.procs import ManagedProcess, free_port, stop_all
from pdgate.deploy.local.stack import LocalStack, SingleInstance, StackConfig, host_cpus, wait_router_ready
from pdgate.deploy.local.vllm_env import repo_root
from pdgate.deploy.local.vllm_instance import ServeFlags

from tests.e2e.nixl_pair import AS_SHIPPED, ROUTER_ARGS, NixlPair, process_pinning

Log = Callable[[str], None]


@dataclass(frozen=True)
class Context:
    model_dir: Path
    run_dir: Path
    venv: Path | None
    flags: ServeFlags
    pd_min_tokens: Callable[[], int]  # asked when the conditional router starts: it may be this run's measure
    log: Log


@dataclass
class Running:
    """One setup, serving: its router's URL and the engine processes whose pinning the report reads."""

    name: str
    url: str
    engines: dict[str, int] = field(default_factory=dict)  # engine name -> pid
    router_pid: int | None = None
    decode_log: Path | None = None  # pdgate's decode: its connector logs each KV load's timing
    decode_url: str | None = None  # NIXL's decode: vllm:nixl_xfer_time_seconds on its /metrics
    direct_url: str | None = None  # an engine of the setup asked directly: the one-instance answer
    engine_urls: list[str] = field(default_factory=list)  # whose prefix-cache counters are read per point

    def pinning(self) -> dict[str, list[dict[str, Any]]]:
        """What each process ended with (CPU set -> threads, nice), read back from /proc."""
        return {name: process_pinning(pid) for name, pid in self.engines.items()}


def _router(name: str, argv: list[str], run_dir: Path, env: dict[str, str] | None = None) -> ManagedProcess:
    full = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", *argv, *ROUTER_ARGS]
    penv = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return ManagedProcess(name, full, log_path=run_dir / f"{name}.log", env=penv, cwd=repo_root()).start()


class Replicas:
    """colocated: two connector-less replicas, launched at once; `ready` waits for them and starts their
    router (so pd's engines can boot meanwhile)."""

    def __init__(self, ctx: Context) -> None:
        cpus = host_cpus()
        self._ctx = ctx
        self.router: ManagedProcess | None = None
        self.reps = [
            SingleInstance(
                model_dir=ctx.model_dir,
                run_dir=ctx.run_dir / "colocated" / f"replica-{i}",
                venv=ctx.venv,
                install=False,
                cpu=str(cpus[i % len(cpus)]),
                flags=ctx.flags,
                log=ctx.log,
            )
            for i in range(2)
        ]

    def ready(self) -> Running:
        ctx = self._ctx
        for r in self.reps:
            r.wait()
        port = free_port()
        argv = ["--port", str(port), "--both-path", "whole", "--block-size", str(ctx.flags.block_size)]
        for r in self.reps:
            argv += ["--prefill", r.url, "--decode", r.url]
        self.router = _router("colocated-router", argv, ctx.run_dir / "colocated")
        url = f"http://127.0.0.1:{port}"
        wait_router_ready(self.router, url, ctx.log, [r.proc for r in self.reps if r.proc is not None])
        engines = {f"replica-{i}": r.proc.pid for i, r in enumerate(self.reps) if r.proc is not None and r.proc.pid}
        return Running("colocated", url, engines, self.router.pid, engine_urls=[r.url for r in self.reps])

    def stop(self) -> None:
        if self.router is not None:
            stop_all([self.router])
        for r in self.reps:
            r.stop()


@contextmanager
def colocated(ctx: Context) -> Iterator[Replicas]:
    reps = Replicas(ctx)
    try:
        for r in reps.reps:
            r.launch()
        yield reps
    finally:
        reps.stop()


@contextmanager
def pd_stack(ctx: Context) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model_dir=ctx.model_dir,
        run_dir=ctx.run_dir / "pd",
        venv=ctx.venv,
        install=False,
        port=free_port(),
        block_size=ctx.flags.block_size,
        max_model_len=ctx.flags.max_model_len,
        router_args=ROUTER_ARGS,
        connector_extra={"heartbeat_s": HEARTBEAT_S},  # see goodput_plan.SHARED_ENGINES
    )
    with LocalStack(cfg, log=ctx.log) as stack:
        yield stack


def pd_running(stack: LocalStack) -> Running:
    engines = {h.instance_id: h.proc.pid for h in stack.instances if h.proc.pid is not None}
    [decode] = stack.by_role("decode")
    pid = stack.router.pid if stack.router else None
    urls = [h.url for h in stack.instances]
    return Running("pd", stack.url, engines, pid, decode_log=decode.log_path, engine_urls=urls)


@contextmanager
def conditional(ctx: Context, stack: LocalStack) -> Iterator[Running]:
    """A second router on the PD stack's engines, deciding per request (`router/decider.py`)."""
    port = free_port()
    argv = ["--port", str(port), "--metaserver", stack.metaserver_url]
    argv += ["--disaggregation", "conditional", "--pd-min-tokens", str(ctx.pd_min_tokens())]
    env = {"PDGATE_ROUTER_METASERVER_TOKEN": stack.admin_token}
    router = _router("conditional-router", argv, ctx.run_dir / "pd", env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_router_ready(router, url, ctx.log, [h.proc for h in stack.instances])
        pd = pd_running(stack)
        [prefill] = stack.by_role("prefill")  # whole requests run on the decode: the other engine answers alone
        yield Running(
            "conditional",
            url,
            pd.engines,
            router.pid,
            decode_log=pd.decode_log,
            direct_url=prefill.url,
            engine_urls=pd.engine_urls,
        )
    finally:
        stop_all([router])


@contextmanager
def nixl(ctx: Context) -> Iterator[Running]:
    with NixlPair(
        model_dir=ctx.model_dir,
        run_dir=ctx.run_dir / "nixl",
        venv=ctx.venv,
        flags=ctx.flags,
        tuning=AS_SHIPPED,
        log=ctx.log,
    ) as pair:
        engines = {f"nixl-{e.role}": e.proc.pid for e in pair.engines if e.proc.pid is not None}
        pid = pair.router.pid if pair.router else None
        urls = [e.url for e in pair.engines]
        yield Running("nixl", pair.url, engines, pid, decode_url=pair.engine("decode").url, engine_urls=urls)


class Serving:
    """The setups serving now, started as the run first needs them (bench/goodput_plan.cells): colocated's
    replicas and pd's engines at once, so they take turns point by point on the same cores (an idle vLLM
    engine takes 1-2 % of a core); conditional's router on pd's engines once it is first asked for (its
    threshold is measured from the other two); the stock NIXL pair last, alone, once the others are stopped.
    A setup that fails to start, or fails during its runs (the stock NIXL pair on 2 cores has stalled past
    its own KV lease and lost an engine), is reported to `failed` and left out: the sweep goes on."""

    def __init__(self, names: tuple[str, ...], ctx: Context, failed: Callable[[str, Exception], None]) -> None:
        self._names, self._ctx, self._failed = names, ctx, failed
        self._group = ExitStack()
        self._stack: LocalStack | None = None
        self._paired_up = False
        self.runs: dict[str, Running] = {}
        self.lost: set[str] = set()

    def __enter__(self) -> Serving:
        return self

    def __exit__(self, *exc: object) -> None:
        self._group.close()

    def get(self, name: str) -> Running | None:
        """The setup `name`, serving (started now if it was not); None once it failed."""
        if name in self.lost:
            return None
        if name not in self.runs:
            try:
                self._start(name)
            except Exception as exc:  # reported in the results, the sweep goes on
                self.fail(name, exc)
                return None
        return self.runs.get(name)

    def fail(self, name: str, exc: Exception) -> None:
        self._ctx.log(f"{name} failed: {exc}")
        self.lost.add(name)
        self.runs.pop(name, None)
        self._failed(name, exc)

    def _start(self, name: str) -> None:
        if name == "conditional":
            self._start_paired()
            if self._stack is None:
                raise RuntimeError("pd's engines did not start")
            self.runs[name] = self._group.enter_context(conditional(self._ctx, self._stack))
        elif name in ("colocated", "pd"):
            self._start_paired()
            if name not in self.runs:
                raise RuntimeError(f"{name} did not start")
        else:  # nixl: alone on the cores
            self._group.close()
            self.runs.clear()
            self.runs[name] = self._group.enter_context(nixl(self._ctx))

    def _start_paired(self) -> None:
        """colocated's replicas and pd's stack, launched together; each one's failure is its own."""
        if self._paired_up:
            return
        self._paired_up = True
        with_pd = "pd" in self._names or "conditional" in self._names
        colo = None
        if "colocated" in self._names:
            try:
                colo = self._group.enter_context(colocated(self._ctx))
            except Exception as exc:
                self.fail("colocated", exc)
        if with_pd:
            try:
                self._stack = self._group.enter_context(pd_stack(self._ctx))
                if "pd" in self._names:
                    self.runs["pd"] = pd_running(self._stack)
            except Exception as exc:  # both setups on these engines lack numbers
                for n in ("pd", "conditional"):
                    if n in self._names:
                        self.fail(n, exc)
        if colo is not None:
            try:
                self.runs["colocated"] = colo.ready()
            except Exception as exc:
                self.fail("colocated", exc)

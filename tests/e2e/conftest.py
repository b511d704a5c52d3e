"""Session fixtures of the end-to-end tests: one baseline vLLM and one PD stack, started once.

A vLLM engine takes 45-75 s to start on two cores, so the suite starts as few as it can: the baseline
single instance boots while the 1P1D stack boots; the 2P1D test adds a second prefill to the running
stack at the very end. The other modules on the main stack run before it (`pytest_collection_modifyitems`);
the modules that need engines configured their own way start stacks of their own after it, and stop the
main stack first. Stacks are shared where a module's engines fit another's tests (`FaultStack`,
`EventsStack`; the negative control runs on test_15's faulty decode).

The tests need the vLLM venv (`deploy/local/vllm_env.py` finds it: $PDGATE_VLLM_VENV or
<repo>/.venv-vllm). A missing venv fails the tests; it never skips them. Set PDGATE_E2E_RUN_DIR to
keep every process log in a known folder.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from openai import OpenAI
from pdgate.deploy.local.procs import ManagedProcess, free_port
from pdgate.deploy.local.stack import (
    InstanceHandle,
    LocalStack,
    SingleInstance,
    StackConfig,
    ensure_model,
    wait_router_ready,
)
from pdgate.deploy.local.vllm_env import VllmEnv, find_vllm_env, repo_root
from pdgate.deploy.local.vllm_instance import ServeFlags

from tests.e2e.nixl_pair import LoopbackRouter
from tests.e2e.pdclient import MAX_TOKENS, Answer, Ranked, chat, chat_messages, complete, openai_client, ranked
from tests.support.redis import RedisServer

_RUN_DIR = pytest.StashKey[Path]()


def _log(msg: str) -> None:
    print(f"[e2e] {msg}", flush=True)


class FaultStack:
    """The 1P2D stack of the fault tests (test_08, then test_11): each ends with a decode it killed, so no
    other test shares it, and the next one gets a fresh decode in the dead one's place (one engine started,
    not a whole stack: about a minute of CI). The router takes the decodes in turn and probes health every
    second."""

    def __init__(self, stacks: Stacks) -> None:
        self.stacks = stacks
        self._stack: LocalStack | None = None

    def get(self) -> LocalStack:
        """The stack with one prefill and two live decodes: started on first use, else revived."""
        if self._stack is None:
            args = ("--decode-policy", "round_robin", "--health-interval-s", "1")
            self._stack = self.stacks.start("faults-1p2d", n_decode=2, router_args=args)
            return self._stack
        stack = self._stack
        for dead in [h for h in stack.instances if not h.proc.alive()]:
            stack.remove_instance(dead)
            stack.add_instance(dead.role)
        stack.wait_router_ready()
        return stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.stop()
            self._stack = None


class RouterReplica(LoopbackRouter):
    """A second `pdgate-router` over a running stack's engines and ledger (its redis store): the shape of
    router replicas with their own settings. What the tests read of a stack, for this router."""

    def __init__(self, stack: LocalStack, name: str, router_args: Sequence[str]) -> None:
        assert stack.config.store, "a replica shares the stack's ledger through its store (redis)"
        self.stack = stack
        self.port = free_port()
        argv = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--store", stack.config.store, *router_args]
        self.proc = ManagedProcess(
            name, argv, log_path=stack.run_dir / f"{name}.log", env=stack.router_env(), cwd=repo_root()
        ).start()
        try:
            wait_router_ready(self.proc, self.url, stack.log, [i.proc for i in stack.instances])
        except BaseException:
            self.proc.stop()
            raise

    def by_role(self, role: str) -> list[InstanceHandle]:
        return self.stack.by_role(role)

    def stop(self) -> None:
        self.proc.stop()


class EventsStack:
    """The engines of test_12 and test_16, started once: a 1P1D stack whose engines publish their KV
    events, on a redis store. Its own router is test_16's: it follows the events, routes with
    `cache_aware` and decides with `--disaggregation conditional`. test_12's router is a replica over the
    same engines and ledger that decides the same way but follows no events (`RouterReplica`): one router
    process more instead of two engines more (a minute of CI)."""

    EVENTS_ARGS = (
        *("--disaggregation", "conditional", "--pd-min-tokens", "256"),
        *("--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"),
    )

    def __init__(self, stacks: Stacks, redis_url: str) -> None:
        self.stacks = stacks
        self.store = f"{redis_url}?prefix=e2e-events"
        self._stack: LocalStack | None = None
        self._replicas: list[RouterReplica] = []

    def stack(self) -> LocalStack:
        if self._stack is None:
            self._stack = self.stacks.start("kv-events", kv_events=True, store=self.store, router_args=self.EVENTS_ARGS)
        return self._stack

    def replica(self, name: str, *router_args: str) -> RouterReplica:
        replica = RouterReplica(self.stack(), name, router_args)
        self._replicas.append(replica)
        return replica

    def stop(self) -> None:
        for replica in self._replicas:
            replica.stop()
        self._replicas = []
        if self._stack is not None:
            self._stack.stop()
            self._stack = None


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    env = find_vllm_env()
    problems = env.problems()
    if problems:
        pytest.fail(
            f"the vLLM venv {env.venv} is not ready ({'; '.join(problems)}): create it with "
            "`python3 -m pdgate.deploy.local.vllm_env` or point PDGATE_VLLM_VENV at one",
            pytrace=False,
        )
    return env


@pytest.fixture(scope="session")
def e2e_run_dir(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    chosen = os.environ.get("PDGATE_E2E_RUN_DIR")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("e2e-run")
    path.mkdir(parents=True, exist_ok=True)
    _log(f"process logs under {path}")
    pytestconfig.stash[_RUN_DIR] = path  # for the failure report's log tails
    return path


@pytest.fixture(scope="session")
def model_dir(e2e_run_dir: Path, vllm_env: VllmEnv) -> Path:
    """Built fresh for the session: the build itself is part of what is tested (offline, reproducible)."""
    return ensure_model(e2e_run_dir / "model", vllm_env, _log)


class Baseline:
    """The connector-less single instance, asked once per distinct request (answers are cached)."""

    def __init__(self, instance: SingleInstance) -> None:
        self.instance = instance
        self.client = openai_client(instance.openai_base_url)
        self._cache: dict[object, Answer] = {}
        self._ranked: dict[tuple[tuple[int, ...], int], Ranked] = {}
        self._waited = False

    def _ready(self) -> None:
        if not self._waited:
            self.instance.wait()
            self._waited = True

    def complete(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Answer:
        key = ("completion", tuple(prompt), max_tokens)
        if key not in self._cache:
            self._ready()
            self._cache[key] = complete(self.client, prompt, max_tokens=max_tokens)
        return self._cache[key]

    def ranked(self, prompt: list[int], max_tokens: int) -> Ranked:
        """The greedy answer with its top-3 logprobs at each position (near-tie checks)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._ranked:
            self._ready()
            self._ranked[key] = ranked(self.client, prompt, max_tokens=max_tokens, candidates=3)
        return self._ranked[key]

    def chat(self, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> Answer:
        key = ("chat", tuple((m["role"], m["content"]) for m in messages), max_tokens)
        if key not in self._cache:
            self._ready()
            self._cache[key] = chat(self.client, messages, max_tokens=max_tokens)
        return self._cache[key]


def answers_equal_the_single_instances(
    client: OpenAI, baseline: Baseline, completions: list[tuple[list[int], bool]], chat_seed: int
) -> tuple[int, int]:
    """Each (prompt ids, stream) completion and a 40-word chat, not streamed and streamed, answer the single
    instance's tokens, with the prompt counted whole; returns (requests sent, prompt tokens sent). The stock
    connectors' e2e tests (test_10, test_14) then check how the KV of exactly those requests moved."""
    sent = prompt_tokens = 0
    for prompt, stream in completions:
        got, want = complete(client, prompt, stream=stream), baseline.complete(prompt)
        assert got.prompt_tokens == len(prompt)
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids, f"{len(prompt)} tokens (stream={stream}) differ from one vLLM"
        sent, prompt_tokens = sent + 1, prompt_tokens + len(prompt)
    for stream in (False, True):
        messages = chat_messages(40, seed=chat_seed + int(stream))
        got, want = chat(client, messages, stream=stream), baseline.chat(messages)
        assert got.token_ids == want.token_ids, f"chat (stream={stream}) differs from the single instance"
        assert want.prompt_tokens is not None
        sent, prompt_tokens = sent + 1, prompt_tokens + want.prompt_tokens
    return sent, prompt_tokens


class Stacks:
    """Starts the main 1P1D stack on first use; lets a test stop it to free the cores and memory."""

    def __init__(self, run_dir: Path, model_dir: Path, env: VllmEnv) -> None:
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.env = env
        self._main: LocalStack | None = None
        self.started: list[LocalStack] = []

    def config(self, name: str, **overrides: object) -> StackConfig:
        from pdgate.deploy.local.procs import free_port

        base: dict[str, object] = {
            "n_prefill": 1,
            "n_decode": 1,
            "port": free_port(),
            "model_dir": self.model_dir,
            "run_dir": self.run_dir / name,
            "venv": self.env.venv,
            "install": False,
        }
        base.update(overrides)
        return StackConfig(**base)  # type: ignore[arg-type]

    def start(self, name: str, **overrides: object) -> LocalStack:
        stack = LocalStack(self.config(name, **overrides), log=lambda m: _log(f"{name}: {m}"))
        self.started.append(stack)
        return stack.start()

    def main(self) -> LocalStack:
        if self._main is None:
            self._main = self.start("main")
        else:  # kept from an earlier module: make sure it still has a pair before a test relies on it
            self._main.wait_router_ready()
        return self._main

    def stop_main(self) -> None:
        if self._main is not None:
            self._main.stop()
            self._main = None

    def stop_all(self) -> None:
        for stack in self.started:
            stack.stop()


@pytest.fixture(scope="session")
def _baseline_instance(e2e_run_dir: Path, model_dir: Path, vllm_env: VllmEnv) -> Iterator[SingleInstance]:
    """Launched, not waited for: it boots while the PD stack boots."""
    instance = SingleInstance(
        model_dir=model_dir,
        run_dir=e2e_run_dir / "single",
        venv=vllm_env.venv,
        install=False,
        cpu="1",
        flags=ServeFlags(model_dir=model_dir),
        log=_log,
    ).launch()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="session")
def fault_stack(stacks: Stacks) -> Iterator[FaultStack]:
    holder = FaultStack(stacks)
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture(scope="session")
def events_stack(stacks: Stacks, redis_server: RedisServer) -> Iterator[EventsStack]:
    holder = EventsStack(stacks, redis_server.url)
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture(scope="session")
def baseline(_baseline_instance: SingleInstance) -> Baseline:
    return Baseline(_baseline_instance)


@pytest.fixture(scope="session")
def stacks(
    e2e_run_dir: Path, model_dir: Path, vllm_env: VllmEnv, _baseline_instance: SingleInstance
) -> Iterator[Stacks]:
    pool = Stacks(e2e_run_dir, model_dir, vllm_env)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture
def pd_stack(stacks: Stacks) -> LocalStack:
    """The main PD stack (1P1D until the 2P1D test adds a prefill)."""
    return stacks.main()


@pytest.fixture
def router_client(pd_stack: LocalStack) -> OpenAI:
    return openai_client(pd_stack.openai_base_url)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed e2e test's report ends with the last lines of every process log written while it ran (the
    router's, the engines'): CI keeps only the report, and a flake is read from it or not at all."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    run_dir = item.config.stash.get(_RUN_DIR, None)
    if not report.failed or call.when != "call" or run_dir is None:
        return
    since = call.start
    for log_path in sorted(run_dir.glob("**/*.log")):
        with contextlib.suppress(OSError):
            if log_path.stat().st_mtime >= since:
                lines = log_path.read_text(errors="replace").splitlines()[-40:]
                report.sections.append((f"log {log_path.relative_to(run_dir)} (last 40 lines)", "\n".join(lines)))


# Modules on the main 1P1D stack that run before test_05 turns it into 2P1D (test_09 counts one prefill).
# In file order the main stack started three times
# (test_01, test_09 after test_07 stopped it, test_drop_in after test_16), about a minute of CI each.
_MAIN_STACK_FIRST = ("test_09_load.py", "test_drop_in.py")
_BEFORE = "test_05_two_prefills.py"
_FAULTS = ("test_08_faults.py", "test_11_resume.py")
_EVENTS = ("test_12_goodput_quick.py", "test_16_kv_events.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move `_MAIN_STACK_FIRST`'s tests right before `_BEFORE`'s, test_11's right after test_08's and
    test_16's right after test_12's, keeping every other test in file order."""
    moved = [i for i in items if i.path.name in _MAIN_STACK_FIRST]
    moved.sort(key=lambda i: _MAIN_STACK_FIRST.index(i.path.name))  # stable: file order within a module
    rest = [i for i in items if i.path.name not in _MAIN_STACK_FIRST]
    at = next((n for n, i in enumerate(rest) if i.path.name == _BEFORE), len(rest))
    items[:] = rest[:at] + moved + rest[at:]
    # Shared stacks (`FaultStack`, `EventsStack`): the second module right after the first, not after a
    # stack of another module's.
    for first, second in (_FAULTS, _EVENTS):
        after = [i for i in items if i.path.name == second]
        rest = [i for i in items if i.path.name != second]
        at = max((n + 1 for n, i in enumerate(rest) if i.path.name == first), default=len(rest))
        items[:] = rest[:at] + after + rest[at:]

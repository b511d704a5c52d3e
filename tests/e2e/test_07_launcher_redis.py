"""`pdgate-local up --store redis://...`, the command a newcomer runs, once more end to end: the
launcher starts the router on a real redis-server, a prefill and a decode; its demo request works;
through it the 1P1D outputs equal the single instance's; Redis ends with no live handoff record; and
SIGTERM to the launcher alone stops every process it started.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pdgate.deploy.local.procs import ManagedProcess, free_port
from pdgate.deploy.local.vllm_env import VllmEnv, repo_root

from tests.e2e.conftest import Baseline, Stacks
from tests.e2e.pdclient import (
    chat,
    chat_messages,
    complete,
    delta,
    observe,
    openai_client,
    prompt_ids,
    settled,
    wait_for,
)
from tests.support.redis import RedisServer

pytestmark = pytest.mark.e2e

PREFIX = "e2e"
# The launcher takes an operator's admin token from its environment; the test needs it to see engine URLs.
ADMIN_TOKEN = "e2e-launcher-admin-token"


@dataclass(frozen=True)
class FoundEngine:
    """An engine the launcher started, found through the router and the run dir."""

    instance_id: str
    url: str
    run_dir: Path

    def read_stats(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.run_dir / f"{self.instance_id}.stats.json").read_text())
        except (OSError, ValueError):
            return {}
        return data


@dataclass(frozen=True)
class Launched:
    proc: ManagedProcess
    url: str
    run_dir: Path

    def engine(self, role: str) -> FoundEngine:
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        body = httpx.get(self.url + "/health", headers=auth, timeout=10, trust_env=False).json()
        [inst] = [i for i in body["instances"] if i["role"] == role]
        return FoundEngine(inst["id"], inst["url"], self.run_dir)

    def output(self) -> str:
        return self.proc.log_path.read_text(errors="replace")


def _ppid_and_session() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process (from /proc/<pid>/stat)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":  # a zombie has exited already
                out[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return out


def _in_sessions(sessions: set[int]) -> list[int]:
    return [pid for pid, (_, sid) in _ppid_and_session().items() if sid in sessions]


@pytest.fixture(scope="module")
def launched(
    stacks: Stacks, redis_server: RedisServer, e2e_run_dir: Path, model_dir: Path, vllm_env: VllmEnv
) -> Iterator[Launched]:
    stacks.stop_main()  # free the cores and memory first
    port = free_port()
    run_dir = e2e_run_dir / "launcher"
    argv = [
        str(vllm_env.python),
        "-m",
        "pdgate.deploy.local.launcher",
        "up",
        "--store",
        f"{redis_server.url}?prefix={PREFIX}",
        "--port",
        str(port),
        "--run-dir",
        str(run_dir),
        "--model-dir",
        str(model_dir),
        "--venv",
        str(vllm_env.venv),
        "--no-install",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDGATE_ROUTER_ADMIN_TOKEN=ADMIN_TOKEN)
    proc = ManagedProcess("pdgate-local", argv, log_path=e2e_run_dir / "launcher.out", env=env, cwd=repo_root())
    proc.start()
    try:

        def serving() -> bool:
            if proc.returncode() is not None:
                raise AssertionError(f"pdgate-local exited with {proc.returncode()}:\n{proc.log_tail(40)}")
            return "serving pdgate-tiny" in proc.log_path.read_text(errors="replace")

        wait_for(serving, timeout=900, what="pdgate-local up to serve", interval=0.5)
        yield Launched(proc, f"http://127.0.0.1:{port}", run_dir)
    finally:
        proc.stop()


def test_launcher_demo_answered_with_kv_from_the_prefill(launched: Launched) -> None:
    out = launched.output()
    assert "demo: answer in" in out, out
    pulled = re.search(r"decode loaded (\d+) of the (\d+) prompt tokens", out)
    assert pulled is not None, out
    loaded, prompt = int(pulled.group(1)), int(pulled.group(2))
    # every prompt token but the last came over the transfer; the last the decode may compute itself
    # (an idle decode's synchronous load does: connector/decode_load.py)
    assert prompt > 1 and prompt - 1 <= loaded <= prompt, out
    assert "FAILED" not in out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("length", [20, 33, 64, 300, 2048])
def test_redis_store_pd_matches_single_instance(
    length: int, stream: bool, launched: Launched, baseline: Baseline
) -> None:
    decode = launched.engine("decode")
    before = settled(decode)
    prompt = prompt_ids(length, seed=900 + int(stream))
    got = complete(openai_client(launched.url + "/v1"), prompt, stream=stream)
    assert got.token_ids == baseline.complete(prompt).token_ids
    wait_for(lambda: delta(observe(decode), before)["recv_ok"] == 1, timeout=30, what="the pull to be counted")


def test_redis_store_chat_matches_single_instance(launched: Launched, baseline: Baseline) -> None:
    messages = chat_messages(80, seed=950)
    got = chat(openai_client(launched.url + "/v1"), messages, stream=True)
    assert got.token_ids == baseline.chat(messages).token_ids


def test_redis_holds_no_live_handoff(launched: Launched, redis_server: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    keys = list(client.scan_iter(match="{" + PREFIX + "}:h:*"))
    assert keys, "the ledger in Redis holds no handoff at all: the requests above did not use it"

    def live() -> dict[str, str | None]:
        states = {k: client.hget(k, "state") for k in keys}
        return {k: s for k, s in states.items() if s not in ("DONE", "ABORTED", "EXPIRED")}

    wait_for(lambda: not live(), timeout=60, what="every handoff in Redis to reach a terminal state")
    assert {client.hget(k, "state") for k in keys} == {"DONE"}


def test_sigterm_to_the_launcher_stops_every_process_it_started(launched: Launched) -> None:
    launcher = launched.proc.pid
    assert launcher is not None
    # The launcher starts each child in a session of its own: the router, the prefill, the decode.
    sessions = {pid for pid, (ppid, _) in _ppid_and_session().items() if ppid == launcher}
    assert len(sessions) == 3, f"expected router, prefill and decode, found sessions {sessions}"
    assert len(_in_sessions(sessions)) > 3  # vLLM's EngineCore and worker processes are in there too
    os.kill(launcher, signal.SIGTERM)  # the launcher alone, not its process group
    wait_for(lambda: launched.proc.returncode() is not None, timeout=120, what="the launcher to exit")
    assert launched.proc.returncode() == 143
    wait_for(lambda: not _in_sessions(sessions), timeout=60, what="every process the launcher started to exit")
    assert "stopped" in launched.output()

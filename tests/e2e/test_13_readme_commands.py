"""Every command in README.md's bash blocks runs as written (issue #26 item 5): a README command that does
not work fails here, not in a newcomer's terminal.

The commands run in order from the repository root, in bash, with the vLLM venv's commands. What this
host cannot give them as written is swapped for its local twin: `/etc/pdgate` for a temporary folder,
the session's redis-server for `redis://redis:6379/0`, free ports for 8000/8300, this stack's engines
for 8100/8200, `.venv-vllm/` for the session's venv. The foreground `./deploy/local/up.sh` runs with
`--detach` (the same start-up, without a terminal to hold) and `pdgate-local down` runs last. Servers
(`pdgate-router`, `pdgate-metaserver`) run in the background until they answer HTTP. A `curl` must get
an answer that is not an error. `NOT_HERE` names the commands that cannot run on one host, and why; a
name there that matches no README command fails the unmarked test below.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from pdgate.deploy.local.procs import free_port
from pdgate.deploy.local.state import STATE_FILE, read_state
from pdgate.deploy.local.vllm_env import VllmEnv, repo_root

from tests.e2e.conftest import Stacks
from tests.support.redis import RedisServer

REPO = repo_root()
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
NOT_HERE = {
    "./.ci/run": "runs the whole test suite, this test included",
    'PDGATE_CONNECTOR_METASERVER_TOKEN="$(cat /etc/pdgate/admin-token)" vllm serve MODEL': "MODEL is a placeholder and "
    "head a second host; every e2e test starts this engine command line (LocalStack, vllm_instance.py)",
}
SERVERS = ("pdgate-router", "pdgate-metaserver")
LAST = ("pdgate-local down",)


def readme_commands(text: str) -> list[str]:
    """Each command of the bash blocks as bash reads it: a trailing backslash or an open quote continues
    it on the next line; comments are left out."""
    out: list[str] = []
    for block in FENCE.findall(text):
        line = ""
        for raw in block.splitlines():
            if not line and raw.lstrip().startswith("#"):  # a comment line: its apostrophes open no quote
                continue
            if raw.rstrip().endswith("\\"):
                line += raw.rstrip()[:-1] + " "
                continue
            line += raw
            try:
                shlex.split(line)
            except ValueError:  # a quote still open: the command goes on
                line += "\n"
                continue
            command = _strip_comment(line).strip()
            if command:
                out.append(command)
            line = ""
    return out


def _strip_comment(line: str) -> str:
    """`line` without its comment: a `#` outside quotes, at the start or after a blank."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _not_here(cmd: str) -> bool:
    return any(cmd.startswith(prefix) for prefix in NOT_HERE)


def test_every_command_left_out_is_in_the_readme() -> None:
    commands = readme_commands((REPO / "README.md").read_text())
    assert commands, "no bash block found in README.md"
    for prefix in NOT_HERE:
        assert any(c.startswith(prefix) for c in commands), f"NOT_HERE names a command the README lost: {prefix}"
    assert any(c.startswith("./deploy/local/up.sh") for c in commands)


@dataclass
class Here:
    """This host's twins of what the README's commands name."""

    venv: Path
    etc: Path
    redis_url: str
    port: int = field(default_factory=free_port)  # the local stack's router (:8000 in the README)
    meta_port: int = field(default_factory=free_port)  # the metaserver's (:8300)
    engines: dict[str, str] = field(default_factory=dict)  # the stack's prefill-0 / decode-0 URLs

    def localize(self, cmd: str) -> str:
        cmd = cmd.replace("/etc/pdgate", str(self.etc)).replace(".venv-vllm/", f"{self.venv}/")
        cmd = cmd.replace("redis://redis:6379/0", self.redis_url)
        cmd = cmd.replace("http://head:8300", f"http://127.0.0.1:{self.meta_port}")
        cmd = cmd.replace("--port 8300", f"--port {self.meta_port}")
        cmd = cmd.replace("http://127.0.0.1:8100", self.engines.get("prefill-0", "http://127.0.0.1:8100"))
        cmd = cmd.replace("http://127.0.0.1:8200", self.engines.get("decode-0", "http://127.0.0.1:8200"))
        if "pdgate-router" in cmd:  # each router its own port
            cmd = cmd.replace("--port 8000", f"--port {free_port()}")
        cmd = cmd.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        if cmd.startswith("./deploy/local/up.sh") and "--detach" not in cmd:
            cmd += f" --detach --port {self.port}"
        return cmd


def _port_of(cmd: str) -> int:
    found = re.search(r"--port (\d+)", cmd)
    assert found, f"a server command without --port: {cmd}"
    return int(found.group(1))


def _serve(cmd: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A server command in the background (its own session) until it answers HTTP on its --port."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["bash", "-c", cmd], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{_port_of(cmd)}/health"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{cmd}\nexited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            httpx.get(url, timeout=2, trust_env=False)
            return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError(f"{cmd}\ndid not answer on {url} within 60 s:\n{log.read_text()[-3000:]}")


def _run(cmd: str, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\nexit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if cmd.startswith("curl"):
        assert done.stdout.strip() and '"error"' not in done.stdout, f"{cmd}\nanswered: {done.stdout[:1000]}"
    return done.stdout


@pytest.fixture
def here(
    stacks: Stacks, vllm_env: VllmEnv, model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> Iterator[tuple[Here, dict[str, str]]]:
    stacks.stop_main()  # free the cores and memory for the README's stack
    etc = tmp_path / "etc-pdgate"
    h = Here(venv=vllm_env.venv, etc=etc, redis_url=f"{redis_server.url}?prefix=readme")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDGATE_ROUTER_", "PDGATE_METASERVER_"))}
    env.update(
        PATH=f"{vllm_env.venv}/bin:{env.get('PATH', '')}",
        PDGATE_VLLM_VENV=str(vllm_env.venv),
        PDGATE_LOCAL_MODEL_DIR=str(model_dir),
        PDGATE_LOCAL_RUN_DIR=str(tmp_path / "run"),
        PYTHONUNBUFFERED="1",
    )
    try:
        yield h, env
    finally:
        subprocess.run(
            [str(vllm_env.venv / "bin" / "pdgate-local"), "down"], cwd=REPO, env=env, timeout=120, check=False
        )


@pytest.mark.e2e
def test_the_readmes_commands_run_as_written(here: tuple[Here, dict[str, str]], tmp_path: Path) -> None:
    h, env = here
    commands = [c for c in readme_commands((REPO / "README.md").read_text()) if not _not_here(c)]
    last = [c for c in commands if any(name in c for name in LAST)]
    commands = [c for c in commands if c not in last] + last
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for i, readme_cmd in enumerate(commands):
            cmd = h.localize(readme_cmd)
            if any(f"{s} " in cmd for s in SERVERS):
                servers.append(_serve(cmd, env, tmp_path / f"server-{i}.log"))
                continue
            _run(cmd, env, timeout=1800 if cmd.startswith("./deploy/local/up.sh") else 120)
            if cmd.startswith("./deploy/local/up.sh"):
                state = read_state(REPO / STATE_FILE)
                assert state is not None and state["phase"] == "ready", state
                h.engines = {p["name"]: p["url"] for p in state["processes"] if "url" in p}
    finally:
        for proc in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    assert read_state(REPO / STATE_FILE) is None, "pdgate-local down left its state file"

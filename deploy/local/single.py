"""`SingleInstance`: one plain vLLM engine with the stack's serving flags and no connector, the baseline
that PD outputs are compared against (moved out of stack.py, which is at its size limit)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
from pdgate.deploy.local.model import DEFAULT_MODEL_DIR, Log, ensure_model
from pdgate.deploy.local.procs import ManagedProcess, free_port, wait_http
from pdgate.deploy.local.vllm_env import ensure_vllm_env
from pdgate.deploy.local.vllm_instance import ServeFlags, VllmInstanceSpec, start_engine

__all__ = ["SingleInstance", "http_get_json"]


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

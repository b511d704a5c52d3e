"""How one vLLM server of the local stack is started: its command line and environment.

All instances of a stack share the serving flags (`ServeFlags`), so a baseline instance and a decode
instance compute the same numbers, and only the KV-transfer config differs between roles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdgate.deploy.local.procs import ManagedProcess
from pdgate.deploy.local.tiny_model import MODEL_NAME
from pdgate.deploy.local.vllm_env import repo_root

__all__ = ["ServeFlags", "VllmInstanceSpec", "start_engine", "vllm_base_env", "write_logging_config"]

# vLLM configures only its own "vllm" logger, so the connector's INFO lines (registration, one line per
# KV transfer with its claim/pull/confirm times) would go nowhere. This is vLLM's default logging
# config (vllm/logger.py) with our packages added to the same handler, given to vLLM through its own
# VLLM_LOGGING_CONFIG_PATH.
_LOG_FORMAT = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
_LOGGED_PACKAGES = ("vllm", "pdgate")


def write_logging_config(path: Path, level: str = "INFO") -> Path:
    """Write the engines' logging config (vLLM's default plus the pdgate packages) to `path`."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": _LOG_FORMAT,
                "log_level": level,
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {name: {"handlers": ["vllm"], "level": level, "propagate": False} for name in _LOGGED_PACKAGES},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class ServeFlags:
    """`vllm serve` flags shared by every instance of one stack."""

    model_dir: Path
    served_name: str = MODEL_NAME
    block_size: int = 32  # the CPU backend needs a multiple of 32; its default (128) hides short prompts
    max_model_len: int = 4096
    max_num_seqs: int = 16
    dtype: str = "bfloat16"
    seed: int = 0
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB: 1 is the smallest explicit value

    def args(self) -> list[str]:
        return [
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--seed",
            str(self.seed),
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--uvicorn-log-level",
            "warning",
        ]


def vllm_base_env(
    repo: Path, *, kv_cache_gib: int = 1, cpu: str | None = None, logging_config: Path | None = None
) -> dict[str, str]:
    """Environment of a vLLM server here: loopback only, offline, small KV cache, pinned OMP threads."""
    env = dict(os.environ)
    # Our own variables must not leak from the caller's shell into vLLM's choices.
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    # The KV cache's size: the operator's own VLLM_CPU_KVCACHE_SPACE (GiB) wins over the stack's default.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.update(
        {
            # Without it vLLM advertises the machine's non-loopback address to its own processes.
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # NIXL's UCX backend: loopback only, shared memory and TCP between processes of one host.
            "UCX_NET_DEVICES": "lo",
            # ...and not its InfiniBand module: loaded wherever libibverbs is (the Mooncake wheel needs it),
            # on a host without RDMA it segfaults the process at exit (libnl's destructor).
            "UCX_MODULES": "^ib",
            "PYTHONUNBUFFERED": "1",
            # The connector is imported by module path inside vLLM's processes.
            "PYTHONPATH": os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p),
        }
    )
    if logging_config is not None:
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    if cpu is not None:
        # With the default ("auto") every worker binds core 0: give each instance its own core.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    return env


@dataclass(frozen=True)
class VllmInstanceSpec:
    """One vLLM server: a name for logs, a port, a CPU binding and an optional KV-transfer config."""

    name: str
    port: int
    cpu: str | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, python: Path, flags: ServeFlags) -> list[str]:
        argv = [str(python), "-m", "pdgate.deploy.local.vllm_cli", "serve", *flags.args()]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config), sort_keys=True)]
        return argv + list(self.extra_args)

    def env(self, repo: Path, flags: ServeFlags, logging_config: Path | None = None) -> dict[str, str]:
        env = vllm_base_env(repo, kv_cache_gib=flags.kv_cache_gib, cpu=self.cpu, logging_config=logging_config)
        env.update(self.extra_env)
        return env


def start_engine(
    spec: VllmInstanceSpec,
    python: Path,
    flags: ServeFlags,
    run_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> ManagedProcess:
    """Start one vLLM engine (`spec.name`), logging to run_dir/<name>.log, with vLLM's environment and
    logging config unless `env` is given; `wrap` goes in front of its argv (e.g. taskset)."""
    if env is None:
        env = spec.env(repo_root(), flags, write_logging_config(run_dir / "vllm-logging.json"))
    argv = [*wrap, *spec.argv(python, flags)]
    log_path = run_dir / f"{spec.name}.log"
    return ManagedProcess(spec.name, argv, log_path=log_path, env=dict(env), cwd=repo_root()).start()

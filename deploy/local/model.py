"""Which model the local stack serves, and under which name.

Why its own module: the stack (`stack.py`), the baseline engine (`single.py`) and the launcher all need
the same two rules, and the stack module is at its size limit.

- `ensure_model`: a folder with `config.json` is a checkpoint the user brought, served as it is and
  never written to; otherwise the tiny random-weight model is built there (offline).
- `served_model_name`: the name clients send as `model`. The tiny model keeps its name (`pdgate-tiny`);
  a checkpoint is served under its folder's name (`~/models/Qwen2.5-0.5B-Instruct` ->
  `Qwen2.5-0.5B-Instruct`), as a user who downloaded it would call it (issue #26: every checkpoint used
  to be served as `pdgate-tiny`). `--served-model-name` names it otherwise.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from pdgate.deploy.local.tiny_model import MODEL_NAME, is_built
from pdgate.deploy.local.vllm_env import VllmEnv, repo_root

__all__ = ["DEFAULT_MODEL_DIR", "Log", "StackError", "ensure_model", "served_model_name"]

DEFAULT_MODEL_DIR = Path(os.environ.get("PDGATE_MODEL_DIR", "~/.cache/pdgate/pdgate-tiny")).expanduser()

Log = Callable[[str], None]


class StackError(RuntimeError):
    """The stack could not be started; the message says which part failed and where its log is."""


def served_model_name(model_dir: Path, given: str | None = None) -> str:
    """The model's name as clients send it: `given`, else the tiny model's own name, else the folder's."""
    if given:
        return given
    model_dir = Path(model_dir).expanduser()
    if is_built(model_dir) or not (model_dir / "config.json").is_file():  # the tiny one (or about to be built)
        return MODEL_NAME
    return model_dir.resolve().name


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

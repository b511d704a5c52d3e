"""The Rust peer routers that bench/router.py measures beside pdgate-router, in a bench-only venv.

Why a venv of its own (`.venv-peers`, git-ignored): the two wheels (`vllm-router`, `sglang-router`) are
Rust binaries packaged for PyPI and pull their own Python dependencies; keeping them apart from
`.venv-vllm` means a benchmark dependency can never move a pin that pdgate or vLLM runs with.
The same venv also gets `py-spy`, the sampling profiler the router's profile was taken with.

    python bench/peers_env.py            # create or update .venv-peers, print the peers' binaries
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

__all__ = ["PEERS_VENV", "PEER_MODES", "PINS", "ensure", "peer_binary", "peer_command"]

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".venv-peers"
PINS = ["vllm-router==0.1.17", "sglang-router==0.3.2", "py-spy==0.4.3"]


def _bin(name: str) -> Path:
    return PEERS_VENV / "bin" / name


def peer_binary(name: str) -> Path | None:
    """Path of `name` (`vllm-router`, `sglang-router`, `py-spy`, `python`) in the peers venv, or None."""
    path = _bin(name)
    return path if path.exists() else None


def ensure(quiet: bool = False, force: bool = False) -> Path:
    """Create `.venv-peers` if missing and install PINS into it (skipped when every binary is there)."""
    if not force and all(_bin(n).exists() for n in ("python", "vllm-router", "sglang-router", "py-spy")):
        return PEERS_VENV
    if not _bin("python").exists():
        venv.EnvBuilder(with_pip=True, clear=False, symlinks=True).create(PEERS_VENV)
    cmd = [str(_bin("python")), "-m", "pip", "install", "--disable-pip-version-check", *PINS]
    if quiet:
        cmd.insert(4, "-q")
    subprocess.run(cmd, check=True)
    return PEERS_VENV


def main() -> None:
    ensure(force=True)
    for name in ("vllm-router", "sglang-router", "py-spy"):
        print(f"{name:<14} {peer_binary(name) or shutil.which(name) or 'missing'}")
    print(f"python         {_bin('python')} ({sys.version.split()[0]} here)")


if __name__ == "__main__":
    main()


PEER_MODES = ("vllm-router", "sglang-router")


def peer_command(mode: str, port: int, prom_port: int, prefill: list[str], decode: list[str]) -> list[str]:
    """The command line of a Rust peer in PD mode, round robin on both sides, in front of `prefill`/`decode`.

    vllm-router (`--vllm-pd-disaggregation`) speaks vLLM's NixlConnector protocol: prefill with
    `kv_transfer_params.do_remote_decode` and `max_tokens` 1, then decode with the prefill's answered
    params, which is what pdgate-sim serves. The SGLang router (`--pd-disaggregation`) speaks SGLang's:
    it adds `bootstrap_host`/`bootstrap_port`/`bootstrap_room` and sends the same request to P and D at
    once; the sim has no bootstrap server and answers both as plain completions, so that row measures
    the SGLang router's own PD dispatch (two upstream requests per client request, in parallel).
    Each gets its own Prometheus port: both default to 29000 and would collide.
    """
    if mode not in PEER_MODES:
        raise ValueError(f"unknown peer {mode}")
    ensure(quiet=True)
    workers = [a for u in prefill for a in ("--prefill", u)] + [a for u in decode for a in ("--decode", u)]
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    common += ["--prometheus-port", str(prom_port), "--prometheus-host", "127.0.0.1"]
    if mode == "vllm-router":
        return [str(_bin("vllm-router")), *common, "--vllm-pd-disaggregation", *workers, "--log-level", "warning"]
    launch = [str(_bin("python")), "-m", "sglang_router.launch_router"]
    return [*launch, *common, "--pd-disaggregation", *workers, "--log-level", "warn"]

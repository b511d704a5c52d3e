"""The ``harness`` fixture: every conformance case runs once per transport.

A transport is skipped only when its package is not installed (the reason says which); anything else that
goes wrong (a missing system library such as libibverbs for Mooncake) fails the case. deploy/test.sh
installs the ``mooncake`` extra and libibverbs1, so CI runs all three.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.transport_conformance.harness import (
    REPO,
    Harness,
    LLMDataDistHarness,
    MooncakeHarness,
    NixlHarness,
    ProcessHarness,
)

# kind -> the top-level package that must be installed (llm_datadist runs through tests/fakes).
_PACKAGES = {"nixl": "nixl", "mooncake": "mooncake", "llmdatadist": None}


@pytest.fixture(params=list(_PACKAGES))
def harness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    kind: str = request.param
    package = _PACKAGES[kind]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"the {kind} transport's package {package!r} is not installed (pip install 'pdgate[{kind}]')")
    h: Harness
    if kind == "llmdatadist":
        h = LLMDataDistHarness()
    else:
        cls: type[ProcessHarness] = NixlHarness if kind == "nixl" else MooncakeHarness
        for key, value in cls.env_vars.items():
            monkeypatch.setenv(key, value)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        h = cls(env)
    try:
        yield h
    finally:
        h.close()

"""pdgate-local's CPU placement: an engine is pinned to a core only when every engine can have its own.

Why (measured, docs/NIXL.md "1P2D on two cores"): with three engines on two cores, round robin pinned the
prefill and decode-1 to core 0. While the prefill held KV for a decode it stepped without pause and its
worker busy-waited between steps, and decode-1 got no CPU time at all until the handoffs expired: its
loads failed before any fault was injected. The end-to-end check is tests/e2e/test_08_faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pdgate.deploy.local import stack as stack_mod
from pdgate.deploy.local.stack import LocalStack, StackConfig


def _placements(tmp_path: Path, *, n_prefill: int, n_decode: int, launches: int) -> list[str]:
    stack = LocalStack(StackConfig(n_prefill=n_prefill, n_decode=n_decode, run_dir=tmp_path), log=lambda _: None)
    return [stack._next_cpu() for _ in range(launches)]


def test_more_engines_than_cores_pins_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_mod, "host_cpus", lambda: [0, 1])
    assert _placements(tmp_path, n_prefill=1, n_decode=2, launches=3) == ["nobind"] * 3


def test_one_core_per_engine_when_there_are_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_mod, "host_cpus", lambda: [2, 5])
    # 1P1D on two cores: each engine its own core. A third engine added later (add_instance) would share
    # a core with a pinned one, so it is left unpinned.
    assert _placements(tmp_path, n_prefill=1, n_decode=1, launches=3) == ["2", "5", "nobind"]

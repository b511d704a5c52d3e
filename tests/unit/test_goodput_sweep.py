"""bench/goodput.py's sweep, without engines: which setup runs which rate in which order, what is run
again, the waits between points, and the SLO probe's retry. The points are run by a fake runner that
says how many requests met the SLOs, so each rule is checked in milliseconds."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from goodput_plan import DEFAULT, Plan, Slo


class _Serving:
    """bench/goodput_setups.Serving's surface, without engines: every setup serves until `fail`."""

    def __init__(self) -> None:
        self.runs: dict[str, Any] = {}
        self.lost: list[str] = []

    def get(self, name: str) -> Any:
        if name in self.lost:
            return None
        return self.runs.setdefault(name, type("Run", (), {"name": name, "pinning": lambda self: {}})())

    def fail(self, name: str, exc: Exception) -> None:
        self.lost.append(name)
        self.runs.pop(name, None)


def _sweep(tmp_path: Path, setups: tuple[str, ...], w: str, runner: Any, result: dict[str, Any] | None = None) -> Any:
    """bench/goodput.Sweep over `setups` on workload `w`, its points run by `runner` (no engine, no dataset)."""
    import argparse

    from goodput import Sweep

    args = argparse.Namespace(model_dir=tmp_path, budget_min=0.0, quick=False, out=tmp_path / "r.json")
    if result is None:
        result = {"setups": {}, "slo": {w: {"ttft_ms": 100.0, "tpot_ms": 10.0, "capacity_rps": 5.0}}}
    sweep = Sweep(Plan(DEFAULT, setups, (w,)), args, tmp_path, result)
    sweep.data = type("Data", (), {"file": lambda self, *a: tmp_path / "ds.jsonl"})()
    sweep.runner = runner
    sweep._warm = lambda run: None
    return sweep


def test_setups_take_turns_at_each_rate_and_only_close_calls_are_repeated(tmp_path: Path) -> None:

    share = {"colocated": 1.0, "pd": 0.2, "conditional": 0.95}  # of a point's requests that meet the SLOs
    calls: list[tuple[str, float]] = []

    def runner(run: Any, model_dir: Path, ds: Path, out: Path, slo: Slo, *, n: int, rate: float, **kw: Any) -> Any:
        calls.append((run.name, rate))
        good = round(share[run.name] * n)
        return {"rate": rate, "sent": n, "good": good, "goodput": good / 5.0}

    sweep = _sweep(tmp_path, ("colocated", "pd", "conditional"), "W2", runner)
    sweep.run(_Serving())
    result = sweep.result

    low, high = (f * 5.0 for f in DEFAULT.rate_factors)
    first = calls[: calls.index(("colocated", low), 1)]  # the first cell: colocated and pd
    # pd met the SLOs for 20 % of its first point: no higher rate, no repeat; colocated ran both, grew, and
    # repeated its best (the growth point, which all met the SLOs).
    assert first[:2] in ([("colocated", low), ("pd", low)], [("pd", low), ("colocated", low)])
    assert [c for c in first if c[0] == "pd"] == [("pd", low)]
    assert [r for s, r in first if s == "colocated"] == [low, high, 2 * high, 2 * high]
    second = calls[len(first) :]
    # Beside conditional, colocated runs each rate again (rotating who goes first), without a third run.
    assert [r for s, r in second if s == "conditional"] == [low, high, 2 * high, 2 * high]
    assert [r for s, r in second if s == "colocated"] == [low, high, 2 * high]
    for k in range(0, 6, 2):
        assert {s for s, _ in second[k : k + 2]} == {"colocated", "conditional"}  # one rate, both, then on
    assert second[0][0] != second[2][0]  # the order rotates
    points = result["setups"]["colocated"]["workloads"]["W2"]["points"]
    assert [p["repeat"] for p in points] == [False, False, False, True, True, True, True]
    assert points[-1]["beside"] == ["conditional"]


def test_every_setup_runs_colocated_s_best_rate_again_even_far_behind(tmp_path: Path) -> None:
    """The targets compare each setup's best against colocated's, whose best rate is the mean of two or
    three runs: a setup that ran that rate once must run it again, though its own best lies lower and far
    from colocated's (no close call)."""

    low, high = (f * 5.0 for f in DEFAULT.rate_factors)

    def share(name: str, rate: float) -> float:
        if name == "colocated":
            return 0.85  # below GOOD_SHARE: no growth, its best is `high`
        return 1.0 if rate == low else 0.3  # conditional's best is `low`, under half of colocated's best

    calls: list[tuple[str, float]] = []

    def runner(run: Any, model_dir: Path, ds: Path, out: Path, slo: Slo, *, n: int, rate: float, **kw: Any) -> Any:
        calls.append((run.name, rate))
        good = round(share(run.name, rate) * n)
        return {"rate": rate, "sent": n, "good": good, "goodput": good / 5.0}

    sweep = _sweep(tmp_path, ("colocated", "conditional"), "W2", runner)
    sweep.run(_Serving())
    result = sweep.result

    cond = result["setups"]["conditional"]["workloads"]["W2"]["points"]
    assert max(cond, key=lambda p: p["goodput"])["rate"] == low
    assert [r for s, r in calls if s == "conditional"] == [low, high, high]
    assert [r for s, r in calls if s == "colocated"].count(high) == 3  # twice alone, once beside: no fourth


def test_a_point_after_one_on_the_same_engines_waits_for_a_fresh_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pd and conditional share engines through two routers: a report taken during one's point reads as
    the other router's load until the next heartbeat, so a switch between them waits for a fresh one."""

    import goodput
    from goodput_plan import REPORT_FRESH_S

    calls: list[tuple[str, float]] = []
    order: list[str] = []
    monkeypatch.setattr(goodput.time, "sleep", lambda s: order.append(f"sleep {s:g}"))

    def runner(run: Any, model_dir: Path, ds: Path, out: Path, slo: Slo, *, n: int, rate: float, **kw: Any) -> Any:
        calls.append((run.name, rate))
        order.append(run.name)
        return {"rate": rate, "sent": n, "good": n, "goodput": n / 5.0}

    _sweep(tmp_path, ("colocated", "pd", "conditional"), "W4", runner).run(_Serving())

    ran = [x for x in order if not x.startswith("sleep")]
    switches = sum({a, b} == {"pd", "conditional"} for a, b in itertools.pairwise(ran))
    assert switches > 0
    for i, x in enumerate(order):
        if x in ("pd", "conditional"):
            before = [y for y in order[:i] if not y.startswith("sleep")]
            waited = i > 0 and order[i - 1] == f"sleep {REPORT_FRESH_S:g}"
            assert waited == (bool(before) and {before[-1], x} == {"pd", "conditional"}), order


def test_a_probe_with_most_streams_in_one_piece_runs_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    import goodput
    import goodput_run

    probes = [
        {"ttft_ms": 170.0, "tpot_ms": 0.004, "n": 8, "coalesced": 6},
        {"ttft_ms": 20.0, "tpot_ms": 2.0, "n": 8, "coalesced": 1},
    ]
    asked: list[Path] = []

    def fake_unloaded(run: Any, model_dir: Path, ds: Path, out: Path, n: int) -> dict[str, Any]:
        asked.append(out)
        return probes[len(asked) - 1]

    monkeypatch.setattr(goodput_run, "unloaded", fake_unloaded)
    monkeypatch.setattr(goodput.time, "sleep", lambda s: None)
    sweep = _sweep(tmp_path, ("colocated",), "W2", None, {"setups": {}, "slo": {}})
    slo, _ = sweep._slo(type("Run", (), {"name": "colocated"})(), "W2")
    assert len(asked) == 2 and asked[1].name == "unloaded-again.json"
    assert (slo.ttft_ms, slo.tpot_ms) == (80.0, 6.0)  # from the second probe, the one that streamed

"""The chaos suite's issue-24 columns from load records: errors seen by clients, added latency, the verdict.

bench/chaos.py runs minutes against a real stack; these check the arithmetic behind its new columns on
records written as bench/chaos_load.py writes them, so a window off by one side, a percentile of the
wrong requests or a verdict that ignores typed errors fails here in milliseconds. Rendering is checked on
rows with and without the new keys: results written before the columns existed still render.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from chaos_report import render_markdown, render_table
from chaos_run import fault_window, latency, summarize, verdict

T = 1000.0  # the fault


def rec(t0: float, e2e: float, ft: float | None = 0.05, o: str = "ok", **kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"t0": T + t0, "t1": T + t0 + e2e, "s": 1, "o": o, "c": kw.pop("c", None), **kw}
    if ft is not None:
        r["ft"] = ft
    return r


def test_errors_seen_by_clients_count_typed_and_untyped_not_the_load_generators_own() -> None:
    recs = [rec(-1, 0.5), rec(0.5, 0.2, o="typed", c="pd_decode_failed"), rec(0.6, 0.1, o="untyped")]
    recs += [rec(0.7, 0.1, o="client"), rec(1.0, 0.5, p="whole"), rec(1.1, 0.5, p="split")]
    s = summarize(recs, T)
    assert s["client_errors"] == 2
    assert s["served_whole"] == 1
    assert s["typed"] == {"pd_decode_failed": 1} and s["untyped"] == 1 and s["client_stalled"] == 1


def test_fault_window_runs_to_the_heal_or_the_last_error_and_at_least_the_quiet_time() -> None:
    assert fault_window([rec(-1, 0.5)], T, T + 0.01, quiet_s=2.0) == T + 2.0  # a kill: healed at once
    assert fault_window([rec(-1, 0.5)], T, T + 10.0, quiet_s=2.0) == T + 10.0  # down 10 s
    late_err = [rec(3.0, 4.0, o="typed", c="pd_upstream_timeout"), rec(-5, 1.0, o="untyped")]
    assert fault_window(late_err, T, T + 1.0, quiet_s=2.0) == T + 7.0  # an error before the fault is not its


def test_added_latency_is_during_minus_before_of_streams_answered_fully() -> None:
    # The fault function is called at T - 1 and sets up for a second (scenario 4 slows the decodes) before
    # the fault itself at T: "before" is the 2 s before T - 1, the set-up second is in neither period.
    before = [rec(-2.9 + i * 0.01, 0.5, ft=0.1) for i in range(100)]
    setup = [rec(-0.8, 0.4, ft=3.0)]
    during = [rec(-0.2, 1.0, ft=0.1)]  # in flight at the fault
    during += [rec(0.5 + i * 0.01, 2.5, ft=1.1) for i in range(99)]
    outside = [rec(5.0, 9.0, ft=9.0), rec(-3.5, 0.1, ft=9.0)]  # after the window; before the before-period
    failed = [rec(0.5, 20.0, ft=None, o="typed", c="pd_decode_failed")]
    plain = [{**rec(0.5, 30.0, ft=None), "s": 0}]  # non-streaming answers are not in the percentiles
    out = latency(before + setup + during + outside + failed + plain, T, T + 2.0, T - 1.0, before_s=2.0)
    lat = out["latency"]
    assert lat["before"]["n"] == 100 and lat["during"]["n"] == 100
    assert lat["window_s"] == 2.0
    assert lat["before"]["ttft_p50_ms"] == 100.0 and lat["during"]["ttft_p50_ms"] == 1100.0
    assert lat["during"]["ttft_p99_ms"] == 1100.0 and lat["during"]["e2e_p99_ms"] == 2500.0
    assert out["added_ttft_ms"] == [1000.0, 1000.0]
    assert out["added_e2e_ms"] == [2000.0, 2000.0]


def test_no_streams_in_a_period_leaves_the_added_latency_unknown() -> None:
    out = latency([rec(0.5, 1.0)], T, T + 2.0, T, before_s=2.0)
    assert out["latency"]["before"]["n"] == 0 and out["added_e2e_ms"] == [None, None]


def _row(**kw: Any) -> dict[str, Any]:
    row = {"scenario": "9-x", "recovered": True, "untyped": 0, "stranded_handoffs": 0, "held_blocks": 0}
    return {**row, "checks": {}, "engines_survive": True, "client_errors": 0, "typed": {}, **kw}


def test_verdict_fails_on_a_typed_error_where_an_engine_survives() -> None:
    assert verdict(_row())
    assert not verdict(_row(client_errors=3, typed={"pd_no_compatible_pair": 3}))
    assert verdict(_row(client_errors=3, engines_survive=False))
    assert not verdict(_row(client_errors=3, untyped=3, engines_survive=False))  # the old zeros still hold
    assert not verdict(_row(stranded_handoffs=1))


def test_new_columns_render_and_old_results_still_render() -> None:
    new = _row(sent=10, ok=10, added_ttft_ms=[12.4, None], added_e2e_ms=[-3.0, 250.0], served_whole=7)
    new["latency"] = {"before": {"n": 5, "ttft_p50_ms": 10.0}, "during": {"n": 4}, "window_s": 2.0}
    old = {k: v for k, v in _row(sent=10, ok=8, untyped=1, typed={"pd_decode_failed": 1}).items()}
    del old["client_errors"], old["engines_survive"]
    table = render_table([new, old])
    head, row_new, row_old = table.splitlines()[:3]
    assert "errors seen by clients" in head and "added TTFT p50 / p99 ms" in head and "added E2E" in head
    assert "+12 / n/a" in row_new and "-3 / +250" in row_new
    assert row_old.split()[3] == "2"  # derived from typed + untyped for results older than the column
    result = {"rows": [new, old], "machine": {"cpus": 2, "platform": "x", "python": "3", "uptime": ""}}
    result |= {"timing": {"a": 1}, "knobs": {"streams": 1, "trickle": 1, "max_tokens": 1, "quiet_s": 1}}
    md = render_markdown({**result, "started": "now", "mode": "quick", "wall_s": 1})
    assert "**fault window**" in md and "served whole 7" in md and "during its 2.0 s window" in md

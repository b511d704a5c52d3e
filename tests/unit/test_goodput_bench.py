"""bench/goodput.py's arithmetic, without engines: the re-scoring of vLLM's per-request results, the random
prompts and multi-turn conversations, the plan's time budget and the report's headline numbers.

The benchmark runs for many minutes on real vLLM; these catch, in milliseconds, the traps the first sweep
fell into (/work/shared/reference/goodput-method.md): a stream cut after its first token scored as good,
prompts that share prefixes, a single lucky run taken for the peak.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from goodput_plan import (
    DEFAULT,
    QUICK,
    SETUPS,
    WORKLOADS,
    Cell,
    Plan,
    Slo,
    cells,
    dataset_texts,
    estimate_s,
    remaining_s,
    rescore,
)
from goodput_report import best, render_markdown, render_table

SLO = Slo(ttft_ms=400.0, tpot_ms=30.0)


def encode(text: str) -> list[int]:
    """A tokenizer whose re-encoding grows: an id of 4 digits encodes as two tokens."""
    return [0 if len(w) < 4 else 1 for w in text.split() for _ in range(1 if len(w) < 4 else 2)]


def decode(ids: list[int]) -> str:
    return "".join(f" {i}" for i in ids)


def test_a_stream_cut_after_its_first_token_is_not_good_though_vllm_counts_it() -> None:
    result = {
        "duration": 2.0,
        "errors": ["", "", "connection reset", "", ""],
        "output_lens": [64, 1, 0, 64, 64],
        "ttfts": [0.1, 0.05, 0.0, 0.5, 0.1],
        "latencies": [0.1 + 63 * 0.01, 0.05, 0.0, 0.5 + 63 * 0.01, 0.1 + 63 * 0.04],
    }
    scored = rescore(result, SLO)
    # request 0 is good; 1 was cut (1 token); 2 failed; 3 misses the TTFT SLO; 4 misses the TPOT SLO
    assert (scored["sent"], scored["complete"], scored["cut_or_failed"], scored["good"]) == (5, 3, 2, 1)
    assert scored["goodput"] == 0.5 and scored["throughput"] == 1.5
    assert round(scored["tpot_ms"]["p50"], 6) == 10.0 and scored["ttft_ms"]["p50"] == 100.0


def test_prompts_are_random_tokens_within_their_length_and_share_no_prefix() -> None:
    texts = dataset_texts("W3", 8, seed=0, vocab=2048, encode=encode, decode=decode)
    lo, hi = WORKLOADS["W3"].lengths
    assert all(len(encode(t)) <= hi for t in texts) and len(set(texts)) == 8
    assert all(len(encode(t)) >= lo * 0.8 for t in texts)
    firsts = {t.split()[0] + t.split()[1] for t in texts}
    assert len(firsts) == 8  # no two prompts open alike (vLLM's random dataset would)
    again = dataset_texts("W3", 8, seed=0, vocab=2048, encode=encode, decode=decode)
    other = dataset_texts("W3", 8, seed=1, vocab=2048, encode=encode, decode=decode)
    assert again == texts and not set(other) & set(texts)  # same for every setup, fresh for every point


def test_the_unloaded_figures_leave_out_streams_that_arrived_in_one_piece() -> None:
    """A probe stream whose tokens all reached the client at once has its TTFT at the answer's end and a
    TPOT of ~0: taken as the unloaded TPOT, it made the TPOT SLO 0 ms and every point fail."""
    from goodput_plan import unloaded_figures

    # Three streamed (TTFT 20 ms, 2 ms a token), five arrived in one piece (170 ms, then nothing).
    ttfts = [0.020, 0.021, 0.019] + [0.170] * 5
    result = {
        "output_lens": [64] * 8,
        "ttfts": ttfts,
        "latencies": [0.020 + 63 * 0.002, 0.021 + 63 * 0.002, 0.019 + 63 * 0.002] + [0.1702] * 5,
        "errors": [""] * 8,
    }
    u = unloaded_figures(result)
    assert (u["n"], u["coalesced"]) == (8, 5)
    assert u["ttft_ms"] == pytest.approx(20.0) and u["tpot_ms"] == pytest.approx(2.0)
    everyone = unloaded_figures(dict(result, ttfts=[0.170] * 8, latencies=[0.1702] * 8))
    assert everyone["coalesced"] == 8 and everyone["ttft_ms"] == pytest.approx(170.0)  # none streamed: all count


def test_multi_turn_prompts_extend_the_turn_before() -> None:
    texts = dataset_texts("W4", 8, seed=0, vocab=2048, encode=encode, decode=decode)
    convs = 8 // WORKLOADS["W4"].turns
    for c in range(convs):
        turns = texts[c::convs]
        assert len(turns) == WORKLOADS["W4"].turns
        for before, after in itertools.pairwise(turns):
            assert after.startswith(before) and len(encode(after)) > len(encode(before)) + 250
    assert not texts[1].startswith(texts[0])  # conversations share nothing with each other


def test_the_default_plan_fits_the_twenty_minutes_and_quick_covers_the_decider() -> None:
    assert estimate_s(Plan(DEFAULT, tuple(SETUPS), tuple(WORKLOADS))) < 20 * 60  # --budget-min 19 guards the run
    assert QUICK.setups == ("conditional",) and estimate_s(Plan(QUICK, QUICK.setups, QUICK.workloads)) < 5 * 60


def test_colocated_and_pd_take_turns_first_and_conditional_runs_beside_colocated_after_them() -> None:
    order = cells(Plan(DEFAULT, tuple(SETUPS), tuple(WORKLOADS)))
    assert order[:3] == [Cell(w, ("colocated", "pd")) for w in ("W1", "W2", "W3")]  # the threshold's data
    assert order[3:6] == [Cell(w, ("colocated", "conditional")) for w in ("W1", "W2", "W3")]
    assert order[6:8] == [Cell(w, ("colocated", "pd", "conditional")) for w in ("W4", "burst")]
    assert order[8:] == [Cell(w, ("nixl",)) for w in WORKLOADS]  # alone, last
    assert cells(Plan(QUICK, ("conditional",), ("W3",))) == [Cell("W3", ("conditional",))]
    assert cells(Plan(DEFAULT, ("pd",), ("W1", "W4"))) == [Cell("W1", ("pd",)), Cell("W4", ("pd",))]
    plan = Plan(DEFAULT, tuple(SETUPS), tuple(WORKLOADS))
    left = [remaining_s(plan, i) for i in range(len(order))]
    assert left == sorted(left, reverse=True) and left[-1] == 0.0  # nixl's start is counted until it starts


def point(rate: float, goodput: float, **kw: Any) -> dict[str, Any]:
    return {
        "rate": rate,
        "sent": 6,
        "good": round(goodput * 6),
        "goodput": goodput,
        "throughput": kw.pop("throughput", goodput),
        "cut_or_failed": 0,
        "ttft_ms": {"p50": 100.0, "p99": 300.0},
        "tpot_ms": {"p50": 9.0, "p99": 20.0},
        **kw,
    }


def test_the_best_rate_is_the_mean_of_its_runs_not_one_lucky_run() -> None:
    points = [point(0.3, 0.30), point(0.6, 0.55), point(0.6, 0.03, repeat=True), point(1.2, 0.2)]
    b = best(points)
    assert b["rate"] == 0.3 and b["goodput"] == 0.30  # 0.6's runs average 0.29: its first alone would win
    b = best([point(0.3, 0.25), point(0.6, 0.55), point(0.6, 0.45, repeat=True)])
    assert (b["rate"], b["lo"], b["hi"], b["runs"]) == (0.6, 0.45, 0.55, 2)


def test_the_report_gives_ratios_to_colocated_and_says_what_failed() -> None:
    def setup(g: float) -> dict[str, Any]:
        return {
            "workloads": {"W2": {"points": [point(1.0, g)]}, "burst": {"points": [point(9e9, 0.0, throughput=g * 10)]}}
        }

    result = {
        "config": {"model": "pdgate-tiny", "engine_flags": ["--block-size", "32"], "pd_min_tokens": 1024},
        "host": {"python": "3.11", "cpus": 2, "loadavg_before": [1.0, 1.0, 1.0]},
        "slo": {
            "W2": {
                "measured_on": "colocated",
                "unloaded": {"ttft_ms": 50.0, "tpot_ms": 9.0, "n": 8, "coalesced": 1},
                "ttft_ms": 200.0,
                "tpot_ms": 27.0,
                "capacity_rps": 3.0,
            }
        },
        "setups": {"colocated": setup(2.0), "pd": setup(0.8), "nixl": {"workloads": {}, "failed": "RuntimeError: x"}},
    }
    table = render_table(result)
    assert "0.80 (0.40x)" in table and "8.00 (0.40x)" in table  # the burst's headline is its capacity
    doc = render_markdown(result)
    assert "| W2 | 50 | 9.0 | 1 of 8 | 200 | 27.0 | 3.00 |" in doc
    assert "- nixl: RuntimeError: x" in doc
    # The targets are read off the same numbers: W2's conditional is not run here, the burst's PD is.
    assert "| W2 (short chat): conditional >= 0.95x colocated | not run | - |" in doc
    assert "bench/engine_overhead.py" not in doc  # no run of it saved: no section

    # bench/engine_overhead.py's run beside it: the connector's engines over the plain ones, paired per round.
    def row(engine: str, k: int, rps: float) -> dict[str, Any]:
        return {"engine": engine, "round": k, "rps": rps, "ttft_p50_ms": 80.0, "tpot_p50_ms": 4.0}

    rows = [row("plain-0", 0, 10.0), row("plain-1", 0, 10.0), row("pdgate-prefill-0", 0, 9.0)]
    rows += [row("plain-0", 1, 20.0), row("plain-1", 1, 10.0), row("pdgate-decode-0", 1, 12.0)]
    overhead = {"started": "x", "config": {"rounds": 2, "prompts": 48, "concurrency": 8}, "rows": rows}
    doc = render_markdown(result, None, overhead)
    assert "| pdgate-prefill-0 | 9.00 | 80 | 4.00 | 1 |" in doc
    assert "pdgate engines / plain engines, req/s: median of 2 rounds 0.85x (0.80-0.90)" in doc


def test_the_targets_say_met_or_not_from_the_numbers() -> None:
    from goodput_targets import targets_section

    def run(goodput: float, *, tpot: float = 5.0, failed: int = 0) -> dict[str, Any]:
        p = point(1.0, goodput)
        p.update(throughput=goodput * 10, cut_or_failed=failed, sent=10, tpot_ms={"p50": tpot}, ttft_ms={"p50": 90.0})
        p["where"] = {"transfer_ms": 12.0, "decode_first_step_ms": 30.0, "prefill_ms": 80.0}
        return {"workloads": {w: {"points": [dict(p)]} for w in ("W1", "W2", "W3", "burst")}}

    result = {
        "slo": {"W1": {"ttft_ms": 200.0, "tpot_ms": 6.0}},
        "setups": {"colocated": run(2.0), "pd": run(1.0, tpot=14.0), "conditional": run(2.0, failed=1)},
    }
    rows = "\n".join(targets_section(result))
    assert "| W1 (long prompts): PD >= 1.5x colocated | 1.00 / 2.00 req/s = 0.50x | **no** |" in rows
    assert "| W2 (short chat): conditional >= 0.95x colocated | 2.00 / 2.00 req/s = 1.00x | yes |" in rows
    assert "| W3 (mixed): conditional >= the better of colocated and PD | 2.00 vs 2.00 req/s | yes |" in rows
    assert "1 cut or failed of 10 | **no** |" in rows  # the burst's throughput ties, but a request failed
    assert "its TPOT p50 is 14.0 ms (colocated 5.0 ms" in rows and "falls short" in rows and "(12 ms pulled)" in rows
    assert "W4 (multi-turn): TTFT p50 <= 0.6x round-robin PD" in rows and "not run (bench/multiturn.py" in rows

    # A miss smaller than colocated's own spread between two runs at its best rate is within noise, not a
    # loss; a larger one stays a plain no.
    colo = run(2.0)
    colo["workloads"]["W3"]["points"].append(dict(colo["workloads"]["W3"]["points"][0], goodput=1.6, repeat=True))
    result["setups"] = {"colocated": colo, "pd": run(1.0), "conditional": run(1.7)}
    rows = "\n".join(targets_section(result))
    w3 = "| W3 (mixed): conditional >= the better of colocated and PD | 1.70 vs 1.80 req/s; colocated's runs "
    assert w3 + "at that rate 22% apart | within noise |" in rows
    assert "| W2 (short chat): conditional >= 0.95x colocated | 1.70 / 2.00 req/s = 0.85x | **no** |" in rows

    # The W3 row says when the decider kept every request whole (conditional then routes as colocated
    # does), and says nothing of it once one request went PD.
    cond = result["setups"]["conditional"]["workloads"]["W3"]["points"][0]
    cond["where"] = dict(cond["where"], decisions={"whole:short_prompt": 30.0})
    rows = "\n".join(targets_section(result))
    assert "22% apart; the decider kept all 30 requests whole (PD paid at no prompt length here)" in rows
    cond["where"]["decisions"] = {"whole:short_prompt": 29.0, "pd:long_prompt": 1.0}
    assert "kept all" not in "\n".join(targets_section(result))


def test_w4_comes_from_the_multiturn_run_beside_it() -> None:
    from goodput_targets import targets_section

    def summary(p50: float, share: float) -> dict[str, Any]:
        return {
            "requests": 4,
            "failed": 0,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": p50 * 2,
            "ttft_p50_ms_turns_2plus": p50,
            "moved_share": share,
            "moved_share_turns_2plus": share / 2,
            "paths": {"pd": 4},
        }

    multiturn = {
        "started": "then",
        "minutes": 9.0,
        "args": {"conversations": 1, "rate": 0.5, "turns": 4, "first": 832, "grow": 320},
        "setups": {
            "round-robin": {"summary": summary(400.0, 1.0), "load_before": 1.0, "load_after": 3.0},
            "kv-events": {"summary": summary(200.0, 0.8), "load_before": 3.0, "load_after": 3.5},
        },
    }
    rows = "\n".join(targets_section({"setups": {}}, multiturn))
    assert "TTFT p50 with KV events <= 0.6x round-robin PD | 200 / 400 ms = 0.50x | yes |" in rows
    moved = next(r for r in rows.splitlines() if "KV moved per later turn" in r)
    assert "| 0.40x over turns 2+ (round robin 0.50x); 0.80x over all turns" in moved and moved.endswith("**no** |")
    doc = render_markdown(
        {
            "setups": {},
            "slo": {},
            "host": {"cpus": 2, "python": "3", "loadavg_before": [0.5]},
            "config": {"model": "m", "engine_flags": [], "pd_min_tokens": 1},
        },
        multiturn,
    )
    assert "## W4: multi-turn conversations on 2P2D" in doc and "| kv-events | 4 | 0 | 200 / 400 |" in doc
    assert "| 3.0 / 3.5 |" in doc  # the load during each setup's run


def test_each_request_keeps_its_prompt_length_and_verdict() -> None:
    result = {
        "duration": 1.0,
        "errors": ["", "boom", ""],
        "input_lens": [128, 900, 2048],
        "output_lens": [64, 0, 64],
        "ttfts": [0.1, 0.0, 0.9],
        "latencies": [0.1 + 63 * 0.01, 0.0, 0.9 + 63 * 0.01],
    }
    assert rescore(result, SLO)["requests"] == [[128, 1], [900, 0], [2048, 0]]  # failed; TTFT over the SLO


def test_the_threshold_is_where_pd_meets_the_slos_as_often_as_colocated() -> None:
    from goodput_threshold import MIN_REQUESTS, attainment, break_even, threshold_section

    def rows(share_by_len: dict[int, float], n: int = 10) -> list[list[int]]:
        return [[tokens, int(i < share * n)] for tokens, share in share_by_len.items() for i in range(n)]

    colocated = attainment(rows({128: 0.9, 700: 0.8, 1200: 0.6, 1800: 0.5, 2500: 0.4}))
    pd = attainment(rows({128: 0.3, 700: 0.6, 1200: 0.7, 1800: 0.5, 2500: 0.6}))
    assert colocated[0] == (9, 10) and pd[3] == (7, 10)  # 128 in bin 0, 1,200 in 1,024-1,535
    assert break_even(colocated, pd) == 1024  # behind at 700, level or ahead from 1,024 up
    # A win below a loss does not count: PD must hold from the edge through every longer bin.
    assert break_even(colocated, attainment(rows({128: 1.0, 700: 0.9, 1200: 0.5, 1800: 0.9, 2500: 0.9}))) == 1536
    assert break_even(colocated, attainment(rows({2500: 0.1}))) is None  # behind in the longest bin
    # Too few requests in a bin say nothing either way.
    thin = attainment(rows({700: 1.0}, n=MIN_REQUESTS - 1) + rows({2500: 0.4}))
    assert break_even(colocated, thin) == 2048

    def run(share: dict[str, dict[int, float]]) -> dict[str, Any]:
        def pts(s: str, rate: float) -> dict[str, Any]:
            return {"rate": rate, "requests": rows(share[s])}

        setups = {s: {"workloads": {"W3": {"points": [pts(s, 1.0), pts(s, 1.0), pts(s, 9.0)]}}} for s in share}
        setups["colocated"]["workloads"]["W3"]["points"].pop()  # 9.0 req/s only on PD: it must not count
        return {"setups": setups}

    doc = run(
        {
            "colocated": {128: 0.9, 1800: 0.5},
            "pd": {128: 0.2, 1800: 0.8},
            "conditional": {128: 0.9, 1800: 0.8},
        }
    )
    lines = "\n".join(threshold_section(doc, 1024))
    assert "| 0-255 | 9/10 (90 %) | 2/10 (20 %) | 9/10 (90 %) |" in lines  # one run per shared rate
    assert "Measured break-even: 1,536 prompt tokens" in lines and "`--pd-min-tokens 1024`" in lines
    assert threshold_section({"setups": {}}, 1024) == []


def test_the_conditional_setup_runs_at_the_measured_break_even() -> None:
    from goodput_threshold import measured_threshold

    def setups(colo: dict[int, float], pd: dict[int, float]) -> dict[str, Any]:
        def pts(share: dict[int, float]) -> dict[str, Any]:
            reqs = [[t, int(i < s * 10)] for t, s in share.items() for i in range(10)]
            return {"workloads": {"W1": {"points": [{"rate": 1.0, "requests": reqs}]}}}

        return {"setups": {"colocated": pts(colo), "pd": pts(pd)}}

    assert measured_threshold(setups({300: 0.9, 2500: 0.4}, {300: 0.5, 2500: 0.6}), 4096) == 2048
    assert measured_threshold(setups({300: 0.9, 2500: 0.6}, {300: 0.5, 2500: 0.4}), 4096) == 4096  # never PD
    assert measured_threshold({"setups": {"colocated": setups({300: 1.0}, {})["setups"]["colocated"]}}, 4096) is None


def test_router_cpu_with_the_decider_is_the_median_of_paired_runs() -> None:
    from goodput_targets import router_cpu_rows

    def run(**cpu: float) -> dict[str, Any]:
        rows = [
            {"scenario": "nonstream", "concurrency": 32, "mode": _mode(m), "cpu_us_per_req": v} for m, v in cpu.items()
        ]
        return {"rows": rows}

    # Paired ratios 1.04, 1.2174, 1.10: the median is 1.10, met (the pooled means would say 1.12x, not met).
    runs = [run(isolated=500, isolated_d=520), run(isolated_d=560, isolated=460), run(isolated=500, isolated_d=550)]
    rows = router_cpu_rows(runs)
    assert rows == [
        "| router CPU per request, decider + KV-event index on, isolated nonstream c=32: <= +10% "
        "| median of 3 paired runs 1.10x (range 1.04-1.22); pooled means 543 / 487 us | yes |"
    ]
    assert router_cpu_rows([*runs[:2], run(isolated=500, isolated_d=600)])[0].endswith("| **no** |")
    broken = {"rows": [{"scenario": "nonstream", "mode": "isolated+decider", "cpu_us_per_req": 1.0, "errors": 3}]}
    assert router_cpu_rows([broken, run(isolated=500)]) == []  # a run with errors says nothing
    # With the default policies measured too, the decider and the index are judged against them (what turning
    # the two on adds); round robin, which hashes nothing, is named beside it.
    both = [run(isolated=400, isolated_p=500, isolated_d=520), run(isolated_d=530, isolated_p=500, isolated=420)]
    assert router_cpu_rows(both) == [
        "| router CPU per request, decider + KV-event index on, isolated nonstream c=32: <= +10% "
        "| median of 2 paired runs 1.05x (range 1.04-1.06); pooled means 525 / 500 us; against round robin "
        "1.28x | yes |"
    ]


def test_the_decider_s_cpu_is_split_into_steps_each_against_the_default_policies() -> None:
    from goodput_targets import attribution_rows

    def run(**cpu: float) -> dict[str, Any]:
        modes = {"p": "policies", "a": "affinity", "c": "cacheonly", "d": "decider"}
        rows = [
            {"scenario": "nonstream", "concurrency": 1, "mode": f"router+{modes[m]}", "cpu_us_per_req": v}
            for m, v in cpu.items()
        ]
        return {"rows": rows}

    rows = attribution_rows([run(p=1000, a=1020, c=1050, d=1100), run(d=1200, c=1100, a=980, p=1000)])
    assert rows == ["| router nonstream c=1 | 1.00x (0.98-1.02) | 1.08x (1.05-1.10) | 1.15x (1.10-1.20) |"]
    assert attribution_rows([run(a=1000, d=1100)]) == []  # no +policies in the run: nothing to pair with
    assert attribution_rows([run(p=1000, d=1100)]) == ["| router nonstream c=1 | - | - | 1.10x (1.10-1.10) |"]


def _mode(name: str) -> str:
    return name.replace("_d", "+decider").replace("_p", "+policies")

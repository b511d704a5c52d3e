"""Renders the goodput results: the console table and docs/PERFORMANCE.md (generated, never hand-edited)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from goodput_plan import SETUPS, TPOT_FACTOR, TTFT_FACTOR, WORKLOADS

from tests.e2e.nixl_pair import describe_pinning

__all__ = ["best", "render_markdown", "render_table"]


def best(points: Sequence[dict[str, Any]], key: str = "goodput") -> dict[str, Any]:
    """The rate whose runs' mean goodput (`key`) is highest: that mean, the range of its runs, the rate."""
    by_rate: dict[float, list[float]] = {}
    for p in points:
        by_rate.setdefault(p["rate"], []).append(p[key])
    rate, runs = max(by_rate.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    return {"rate": rate, "goodput": sum(runs) / len(runs), "lo": min(runs), "hi": max(runs), "runs": len(runs)}


def _f(v: Any, fmt: str = "{:.0f}") -> str:
    return "-" if v is None or v != v else fmt.format(v)


def _cells(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for s, entry in result["setups"].items():
        for w, wl in entry["workloads"].items():
            if wl["points"]:  # a burst's headline is its capacity: complete requests per second
                out[(s, w)] = best(wl["points"], "throughput" if WORKLOADS[w].burst else "goodput")
    return out


def _ratio(cells: dict[tuple[str, str], dict[str, Any]], s: str, w: str) -> str:
    base = cells.get(("colocated", w))
    if s == "colocated" or base is None or not base["goodput"] or (s, w) not in cells:
        return ""
    return f" ({cells[(s, w)]['goodput'] / base['goodput']:.2f}x)"


def render_table(result: dict[str, Any]) -> str:
    cells = _cells(result)
    setups = list(result["setups"])
    workloads = [w for w in WORKLOADS if any((s, w) in cells for s in setups)]
    lines = ["max goodput req/s (ratio to colocated)", "workload  " + "  ".join(f"{s:>22}" for s in setups)]
    for w in workloads:
        row = [
            (f"{_f(cells[(s, w)]['goodput'], '{:.2f}')}{_ratio(cells, s, w)}" if (s, w) in cells else "-")
            for s in setups
        ]
        lines.append(f"{w:<8}  " + "  ".join(f"{c:>22}" for c in row))
    check = result.get("quick_check")
    if check is not None:
        lines.append(f"decider check: {'pass' if check['pass'] else 'FAIL'} {check['decisions']} {check['problems']}")
    return "\n".join(lines)


def _slo_section(result: dict[str, Any]) -> list[str]:
    out = [
        "## SLOs",
        "",
        f"Per workload, measured before its sweep: requests one at a time on `{_first(result)}`; "
        f"TTFT SLO = {TTFT_FACTOR:g}x its TTFT p50, TPOT SLO = {TPOT_FACTOR:g}x its TPOT p50, both over the "
        "streams whose tokens did not reach the client in one piece (on this host one sometimes does: its TTFT "
        "is then the whole answer's time, its TPOT ~0; `coalesced` counts those left out, and a probe with "
        "most of them runs again). The rate ladder is in "
        "units of the unloaded capacity (2 engines / one request's unloaded service time).",
        "",
        "| workload | unloaded TTFT p50 ms | unloaded TPOT p50 ms | coalesced | TTFT SLO ms | TPOT SLO ms "
        "| unloaded capacity req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w, s in result["slo"].items():
        u = s["unloaded"]
        out.append(
            f"| {w} | {_f(u['ttft_ms'])} | {_f(u['tpot_ms'], '{:.1f}')} | {_coalesced(u)} | {_f(s['ttft_ms'])} "
            f"| {_f(s['tpot_ms'], '{:.1f}')} | {_f(s['capacity_rps'], '{:.2f}')} |"
        )
    return out


def _coalesced(u: dict[str, Any]) -> str:
    return f"{u['coalesced']} of {u['n']}" if "coalesced" in u else "-"  # runs before the column have none


def _first(result: dict[str, Any]) -> str:
    first: dict[str, Any] = next(iter(result["slo"].values()), {})
    return str(first.get("measured_on", "colocated"))


def _max_section(result: dict[str, Any]) -> list[str]:
    cells = _cells(result)
    setups = list(result["setups"])
    out = [
        "## Max goodput",
        "",
        "Requests per second that completed with every requested token within both SLOs, at the best rate (the "
        "mean of its runs; in brackets the range when it ran more than once), and the ratio to colocated. "
        "The burst row is 256 requests at once, run twice per setup, and its number is the burst capacity: "
        "requests completed with every token / the run's duration (its goodput is under Every rate).",
        "",
        "| workload | " + " | ".join(setups) + " |",
        "|---|" + "---:|" * len(setups),
    ]
    for w in WORKLOADS:
        if not any((s, w) in cells for s in setups):
            continue
        row = []
        for s in setups:
            c = cells.get((s, w))
            if c is None:
                row.append("-")
                continue
            spread = f" [{c['lo']:.2f}-{c['hi']:.2f}]" if c["runs"] > 1 else ""
            row.append(f"{c['goodput']:.2f}{spread}{_ratio(cells, s, w)} at {_f(c['rate'], '{:.2f}')}")
        out.append(f"| {w}: {WORKLOADS[w].title} | " + " | ".join(row) + " |")
    return out


def _pct(v: float | None) -> float | None:
    return None if v is None else v * 100


def _point_rows(setup: str, points: Sequence[dict[str, Any]]) -> list[str]:
    rows = []
    for p in points:
        m, t, tp = p.get("machine", {}), p["ttft_ms"], p["tpot_ms"]
        rows.append(
            f"| {setup} | {_f(p['rate'], '{:.2f}')}{' (again)' if p.get('repeat') else ''} | {p['good']}/{p['sent']} "
            f"| {p['goodput']:.2f} | {p['cut_or_failed']} | {_f(t['p50'])} / {_f(t['p99'])} "
            f"| {_f(tp['p50'], '{:.1f}')} / {_f(tp['p99'], '{:.1f}')} | {_f(m.get('load1_mean'), '{:.1f}')} "
            f"| {_f((m.get('cpu_busy') or 0) * 100)} % | {_f(_pct(p.get('where', {}).get('prefix_cache_hit_rate')))} |"
        )
    return rows


def _rates_section(result: dict[str, Any]) -> list[str]:
    out = ["## Every rate", ""]
    out.append(
        "TTFT and TPOT over the requests that completed; `cut/failed`: requests with an error or fewer tokens "
        "than asked (never good); load: the 1-minute load average sampled every second during the run; busy: "
        "the cores' busy share during it; cache: the engines' prefix-cache hit rate (% of prompt tokens; random "
        "prompts must not hit, multi-turn turns should)."
    )
    for w in WORKLOADS:
        rows = []
        for s, entry in result["setups"].items():
            rows += _point_rows(s, entry["workloads"].get(w, {}).get("points", []))
        if not rows:
            continue
        out += ["", f"### {w}: {WORKLOADS[w].title}", ""]
        out.append("| setup | rate req/s | good/sent | goodput | cut/failed | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
                   "| load | busy | cache |")  # fmt: skip
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        out += rows
    return out


def _where_section(result: dict[str, Any]) -> list[str]:
    out = [
        "## Where PD's time goes",
        "",
        "At each setup's best rate, means over its requests from the router's histograms "
        "(`pdgate_router_overhead_seconds`: the router's own time; `_handoff_seconds`: the ledger; "
        "`_prefill_seconds`; `_decode_ttft_seconds`: the decode's first byte), the KV transfer (pdgate's decode "
        "log of each load, the pull; NixlConnector: `vllm:nixl_xfer_time_seconds`) and the decode's first step "
        "(its first byte minus the whole KV load). Decisions: the router's `pdgate_router_decisions_total` "
        "(path:reason).",
        "",
        "| setup | workload | router ms | ledger ms | prefill ms | transfer ms | decode first step ms | decisions |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s, entry in result["setups"].items():
        if s == "colocated":
            continue
        for w, wl in entry["workloads"].items():
            if not wl["points"]:
                continue
            rate = best(wl["points"])["rate"]
            p = next(q for q in wl["points"] if q["rate"] == rate)
            wh = p.get("where", {})
            dec = ", ".join(f"{k} {v:.0f}" for k, v in sorted(wh.get("decisions", {}).items())) or "-"
            out.append(
                f"| {s} | {w} | {_f(wh.get('overhead_ms'), '{:.2f}')} | {_f(wh.get('handoff_ms'), '{:.2f}')} "
                f"| {_f(wh.get('prefill_ms'))} | {_f(wh.get('transfer_ms'), '{:.1f}')} "
                f"| {_f(wh.get('decode_first_step_ms'))} | {dec} |"
            )
    return out


def _multiturn_section(multiturn: dict[str, Any] | None) -> list[str]:
    if not multiturn:
        return []
    from multiturn_report import table

    cfg = multiturn.get("args", {})
    return [
        "## W4: multi-turn conversations on 2P2D (bench/multiturn.py)",
        "",
        f"Run {multiturn.get('started', '?')}, {_f(multiturn.get('minutes'), '{:.1f}')} min. "
        "On 1P1D every policy picks the same pair, so this one runs 2 prefills and 2 decodes (four engines "
        "unpinned on the same cores) and one router per setup on the same engines. "
        f"{_f(cfg.get('conversations'))} conversations per setup arriving at {cfg.get('rate', '?')}/s, "
        f"{_f(cfg.get('turns'))} turns each: turn 1 is {_f(cfg.get('first'))} random token ids, each next turn "
        f"the previous prompt, its 64-token answer and {_f(cfg.get('grow'))} new ids. KV moved per turn is the "
        "tokens the decode loaded (its connector's log) over the prompt; a full-prompt transfer is 1.0.",
        "",
        table(multiturn),
    ]


def _threshold_used(cfg: dict[str, Any]) -> str:
    value = cfg.get("pd_min_tokens")
    if value is None:
        return "not started"
    why = {
        "measured": "the break-even this run measured on colocated and PD (below)",
        "flag": "given on the command line",
        "default": "the decider's default: colocated or PD did not run",
    }.get(cfg.get("pd_min_tokens_from", ""))
    return f"`--pd-min-tokens {value}`" + (f" ({why})" if why else "")


def _threshold_lines(result: dict[str, Any]) -> list[str]:
    from goodput_threshold import threshold_section

    lines = threshold_section(result, result.get("config", {}).get("pd_min_tokens"))
    return [*lines, ""] if lines else []


def _overhead_section(overhead: dict[str, Any] | None) -> list[str]:
    """What the connector costs the engines that carry it on whole requests: the conditional setup's
    whole requests run there, colocated's on plain engines."""
    if not overhead:
        return []
    from engine_overhead import summary

    cfg = overhead["config"]
    return [
        "## What the connector costs an engine on whole requests (bench/engine_overhead.py)",
        "",
        f"Run {overhead['started']}. Conditional keeps most requests whole on the PD engines, which carry the "
        "PDGateConnector; colocated runs them on plain vLLM. Each engine asked directly (no router), in turn, "
        f"{cfg['prompts']} W3-like prompts at concurrency {cfg['concurrency']} per round, {cfg['rounds']} rounds; "
        "medians over the rounds, and the ratio of the connector's engines to the plain ones paired round by round. "
        "What is left is mostly vLLM's own: with a KV connector configured its model runner wraps every "
        "attention layer and aggregates the connector's output each step (py-spy on the decode: the "
        "connector's own code under 1 % of the engine core's and the worker's samples).",
        "",
        *summary(overhead),
        "",
    ]


def render_markdown(
    result: dict[str, Any], multiturn: dict[str, Any] | None = None, overhead: dict[str, Any] | None = None
) -> str:
    """docs/PERFORMANCE.md: the goodput run, with bench/multiturn.py's W4 run and bench/engine_overhead.py's
    run beside it when there are ones."""
    from goodput_targets import targets_section  # it reads `best` from here

    host = result["host"]
    out = [
        "# Performance: goodput of PD disaggregation against colocated replicas",
        "",
        "<!-- Generated by bench/goodput.py from bench/results/goodput.json; do not edit by hand. -->",
        "",
        f"Run {result.get('started', '?')}, {_f(result.get('wall_s', 0) / 60, '{:.1f}')} min, "
        f"{host['cpus']} CPUs ({host.get('cpu', 'model not recorded')}), Python {host['python']}, "
        f"load average before {host['loadavg_before'][0]:.1f}. "
        f"Model `{result['config']['model']}`; every engine `vllm serve {' '.join(result['config']['engine_flags'])}`; "
        f"conditional router {_threshold_used(result['config'])}.",
        "",
        "Setups on the same cores (one engine's OMP threads per core, `VLLM_CPU_OMP_THREADS_BIND`; API server "
        "and engine core unpinned), pdgate-router in front of each. colocated, pd and conditional serve side by "
        "side and take turns: at each rate every setup of a group runs one point, in an order that rotates, "
        "before the next rate, so the host's drift (its speed moved by 30 % within hours here) falls on all of "
        "them alike and their ratios are paired in time. The groups, in order: colocated and pd on W1-W3 (the "
        "conditional threshold is measured from them), colocated and conditional on W1-W3 (colocated's two "
        "runs of a rate average), all three on W4 and the burst; the stock NIXL pair last, alone:",
        "",
        *[f"- **{s}**: {SETUPS[s]}" for s in result["setups"]],
        "",
        "Load: `vllm bench serve`, Poisson arrivals, prompts of uniformly random token ids (custom dataset), "
        "64 tokens out, `--ignore-eos`, temperature 0; re-scored from the per-request results: a request is good "
        "only with every requested token, TTFT and TPOT within the SLOs. Few requests per point on this "
        "machine class: points near the knee swing between runs, which is why a setup's best rate runs again "
        "when it is a close call (at least half of colocated's goodput), and every setup that ran colocated's "
        "best rate runs it again, so the ratios compare means of runs, not one run with a mean. "
        "A setup that met the SLOs for under a "
        "quarter of a point's requests runs no higher rate. "
        "The router serves colocated and conditional-whole requests on its whole path (router/whole.py): the "
        "least-loaded live instance, a prefill or a decode alike (`--whole-on any`, the default).",
        "",
        *_slo_section(result),
        "",
        *_max_section(result),
        "",
        *targets_section(result, multiturn),
        "",
        *_multiturn_section(multiturn),
        "",
        *_where_section(result),
        "",
        *_overhead_section(overhead),
        *_threshold_lines(result),
        *_rates_section(result),
        "",
        "## Pinning each setup ended with",
        "",
        "Read back from /proc after the setup's last run: each process's threads by CPU set, and their nice.",
        "",
    ]
    for s, entry in result["setups"].items():
        for name, rows in entry.get("pinning", {}).items():
            out.append(f"- {s}, {name}: {describe_pinning(rows)}")
    failed = [f"- {s}: {e['failed']}" for s, e in result["setups"].items() if e.get("failed")]
    skipped = result.get("skipped_for_budget") or []
    if failed or skipped:
        out += ["", "## What did not run", ""] + failed + [f"- {x}" for x in skipped]
    out.append("")
    return "\n".join(out)

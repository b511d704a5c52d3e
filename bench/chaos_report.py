"""Renders the chaos results: the console table and docs/RELIABILITY.md (generated, never hand-edited)."""

from __future__ import annotations

from typing import Any

__all__ = ["render_markdown", "render_table"]

_COLS = [
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("ok", "answered fully"),
    ("client_errors", "errors seen by clients"),
    ("typed", "typed errors by code"),
    ("untyped", "untyped"),
    ("client_stalled", "load generator's own"),
    ("client_worst_stall_s", "its worst stall s"),
    ("stranded_handoffs", "stranded handoffs"),
    ("held_blocks", "held blocks"),
    ("recovery_s", "recovery s"),
    ("added_ttft_ms", "added TTFT p50 / p99 ms"),
    ("added_e2e_ms", "added E2E p50 / p99 ms"),
    ("load_avg", "load 1m"),
    ("pass", "pass"),
]


# What each column of the scenario table means (issue 10; issue 24 added errors seen and latency).
_COLUMNS_TEXT = (
    "Columns: **sent** requests finished; **answered fully** all tokens and a finish_reason; **errors seen "
    "by clients** every request that did not end answered fully, typed or not (the load generator's own "
    "failures apart): where an engine survives the fault (every scenario here) it must be 0, since a "
    "fault may cost latency, never an error (issue 24); **typed** "
    "errors carrying a pdgate code (HTTP error or SSE error event); **untyped** a 5xx without a code, an "
    "empty or truncated 200, a reset without an error event, a client timeout (must be 0); **load "
    "generator's own** a reset or a client timeout while the load generator itself did not run (it "
    "measures its own event loop) for longer than the router's header timeout (a reset) or half its "
    "connect timeout (a timeout): a starved client, not the stack (bench/chaos_load.py); **its worst "
    "stall s** the longest the load generator's event loop did not run; **stranded "
    "handoffs** READY or CLAIMED records still live after the longest lease chain (must be 0); **held "
    "blocks** prefill KV blocks still held after recovery (must be 0); **recovery s** from the fault to "
    "the end of the last failed request; **added TTFT / E2E p50 / p99 ms** what the fault added to the "
    "time to first token and to the end-to-end latency of streams answered fully: p50 and p99 during "
    "the fault window minus p50 and p99 before it, in the same run. The **fault window** runs from the "
    "fault until it is healed (a killed process is healed at once, or when it is started again; a "
    "stopped one when it is continued; Redis or the metaserver one instance lease after it is back, "
    "while engines re-register) or until the last failed request ended, whichever is later, and lasts "
    "at least the quiet time above; a stream counts in it when it was in flight at some moment of it. "
    "**Before** is the streams that started and ended in the warm-up before the fault (its own set-up, "
    "such as scenario 4's slowed decodes, excluded). Per scenario below: the absolute numbers and "
    "**served whole** (answers the router marked `X-PDGate-Path: whole`, served without "
    "disaggregation). **load 1m** the machine's 1-minute load average as the scenario ended (other "
    "work on the machine included). **pass** every zero above, a recovery and the scenario's own "
    "checks."
)


def _cell(row: dict[str, Any], key: str) -> str:
    if row.get("skipped"):
        return {"scenario": str(row["scenario"]), "pass": "skipped"}.get(key, "-")
    if "error" in row and key == "pass":
        return "ERROR"
    v = row.get(key)
    if key == "client_errors" and v is None and isinstance(row.get("untyped"), int):  # results older than the column
        v = sum((row.get("typed") or {}).values()) + row["untyped"]
    if key == "typed":
        return ", ".join(f"{k} {n}" for k, n in (v or {}).items()) or "0"
    if key == "pass":
        return "yes" if v else "NO"
    if key.startswith("added_") and isinstance(v, list):
        return " / ".join("n/a" if x is None else f"{x:+.0f}" for x in v)
    return "n/a" if v is None else str(v)


def render_table(rows: list[dict[str, Any]], scale: dict[str, Any] | None = None) -> str:
    cells = [[h for _, h in _COLS]] + [[_cell(r, k) for k, _ in _COLS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(_COLS))) for c in cells]
    for r in rows:
        if r.get("error") or r.get("skipped"):
            lines.append(f"  {r['scenario']}: {r.get('error') or r.get('skipped')}")
        if r.get("untyped_examples"):
            lines.append(f"  {r['scenario']} untyped: {r['untyped_examples'][:2]}")
        checks = {k: v for k, v in (r.get("checks") or {}).items() if k.startswith("ok_") and not v}
        if checks:
            lines.append(f"  {r['scenario']} failed checks: {sorted(checks)}")
    if scale is not None:
        lines.append("")
        lines.append(
            f"scale: {scale.get('ok')}/{scale.get('sent')} ok, untyped {scale.get('untyped')}, "
            f"typed {scale.get('typed')}, peak open {scale.get('peak_open_streams')}, "
            f"router RSS {scale.get('router_rss_mb_per_1k_streams')} MB per 1,000 streams "
            f"(idle {scale.get('router_rss_idle_mb')} MB, peak {scale.get('router_rss_peak_mb')} MB), "
            f"fds {scale.get('router_fds_at_peak')} (idle {scale.get('router_fds_idle')}); load generator: "
            f"408 to its late requests {scale.get('client_408')}, failed while it stalled "
            f"{scale.get('client_stalled')}, its worst stall {scale.get('client_worst_stall_s')} s"
            + (f", error {scale['error']}" if scale.get("error") else "")
        )
    return "\n".join(lines)


def _md_row(r: dict[str, Any]) -> str:
    return "| " + " | ".join(_cell(r, k).replace("|", "/") for k, _ in _COLS) + " |"


def _lat_line(name: str, lat: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        v = lat.get(key)
        return "n/a" if v is None else f"{v:.0f}"

    return (
        f"{name} {lat.get('n')} streams, TTFT p50/p99 {ms('ttft_p50_ms')}/{ms('ttft_p99_ms')} ms, "
        f"E2E p50/p99 {ms('e2e_p50_ms')}/{ms('e2e_p99_ms')} ms"
    )


def _latency(r: dict[str, Any]) -> str:
    """Absolute latencies behind the added-latency columns (absent in results older than issue 24)."""
    lat = r.get("latency")
    if not lat:
        return ""
    during = _lat_line(f"during its {lat['window_s']} s window", lat["during"])
    return f"{_lat_line('before', lat['before'])}; {during}"


def _checks(r: dict[str, Any]) -> str:
    c = dict(r.get("checks") or {})
    parts = [f"`{k}`: {v}" for k, v in c.items() if not isinstance(v, dict | list) or len(str(v)) < 160]
    return "; ".join(parts)


def _scenario_line(r: dict[str, Any]) -> str:
    line = f"- **{r['scenario']}** ({r.get('title', '')})"
    if r.get("skipped"):
        return line + f": not run here: {r['skipped']}"
    line += f": streams {r.get('streams_sent')}, client retries {r.get('client_retries')}"
    if r.get("served_whole") is not None:
        line += f", served whole {r['served_whole']}"
    if _latency(r):
        line += f"; {_latency(r)}"
    if r.get("error"):
        line += f"; error: {r['error']}"
    if _checks(r):
        line += f"; {_checks(r)}"
    return line


def _scale_section(result: dict[str, Any]) -> list[str]:
    out: list[str] = []
    s = result.get("scale")
    if not s:
        return out
    out += [
        "",
        "## Scale",
        "",
        f"Run: {s.get('started', result['started'])}; machine load (`uptime`) at its start: "
        f"`{s.get('uptime_start', '?')}`, at its end: `{s.get('uptime_end', '?')}`. Each client sends one "
        "streaming request; decodes send a token every few seconds so every stream stays open at once. "
        f"The clients run in {s.get('load_procs', 1)} load generator process(es) (official `openai` client).",
        "",
        "Failures caused by the load generator are counted apart: **load generator: 408** the router's "
        "typed answer to a client that sent its request later than the header timeout after connecting; "
        "**load generator: stalled** a connection error while the client process itself was stalled "
        "longer than that timeout (it measures its own event loop); **its worst stall** the longest time "
        "the client's event loop did not run.",
        "",
        "| streams sent | answered fully | untyped | typed | load generator: 408 / stalled | its worst stall s "
        "| peak open streams | router RSS MB per 1,000 open streams | router RSS idle / peak MB "
        "| router fds idle / at peak | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s.get('sent')} | {s.get('ok')} | {s.get('untyped')} | {_cell(s, 'typed')} | "
        f"{s.get('client_408', 'n/a')} / {s.get('client_stalled', 'n/a')} | "
        f"{s.get('client_worst_stall_s', 'n/a')} | "
        f"{s.get('peak_open_streams')} | {s.get('router_rss_mb_per_1k_streams')} | "
        f"{s.get('router_rss_idle_mb')} / {s.get('router_rss_peak_mb')} | "
        f"{s.get('router_fds_idle')} / {s.get('router_fds_at_peak')} | {_cell(s, 'pass')} |",
    ]
    if s.get("error"):
        out.append(f"\nScale error: {s['error']}")
    return out


def render_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    m = result["machine"]
    t = result["timing"]
    k = result["knobs"]
    out = [
        "# Reliability: faults under load",
        "",
        "<!-- GENERATED by bench/chaos.py from bench/results/chaos.json. Do not edit by hand: rerun",
        "     `.venv-vllm/bin/python bench/chaos.py` and commit the result. -->",
        "",
        "_This file is generated by `bench/chaos.py` from its results; edits by hand are overwritten._",
        "",
        f"Run: {result['started']}, mode `{result['mode']}`, {result['wall_s']} s. "
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}. "
        f"Machine load (`uptime`) at the start: `{m.get('uptime_start', '?')}`; at the end: `{m['uptime']}`.",
        "",
        "Stack per scenario: Redis (`tests/support/redis.py`), `pdgate-metaserver` on it, "
        "`pdgate-router` (two in scenario 6), 2 prefill + 2 decode `pdgate-sim`s that record READY, claim and "
        f"DONE in the ledger. Load: {k['streams']} concurrent streaming clients plus {k['trickle']} "
        f"non-streaming requests/s, official `openai` client, {k['max_tokens']} tokens per answer. "
        "One fault at a known time; the load runs until no request has failed for "
        f"{k['quiet_s']} s.",
        "",
        _COLUMNS_TEXT,
        "",
        "| " + " | ".join(h for _, h in _COLS) + " |",
        "|" + "---|" * len(_COLS),
        *[_md_row(r) for r in rows],
        "",
        "## Per scenario",
        "",
    ]
    out += [_scenario_line(r) for r in rows]
    out += _scale_section(result)
    out += [
        "",
        "## Leases and timeouts of the stack",
        "",
        "Short on purpose: recovery can be no faster than the slowest lease.",
        "",
        "| " + " | ".join(t) + " |",
        "|" + "---|" * len(t),
        "| " + " | ".join(str(v) for v in t.values()) + " |",
        "",
    ]
    return "\n".join(out)

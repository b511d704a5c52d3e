"""One chaos scenario from start to finish: stack up, load on, one fault at a known time, recovery, verdict.

`run_scenario` owns the sequence every fault shares, so that each scenario in `chaos_faults` is only its
fault. The row it returns is what `docs/RELIABILITY.md` shows:
  sent, ok                 requests finished by the load, and those answered fully
  client_errors            every error a client saw, typed or not (must be 0 where an engine survives the
                           fault: issue 24, a fault costs latency, never an error)
  typed                    errors with a pdgate code, by code
  untyped                  everything else (must be 0), with a few examples
  latency                  p50/p99 TTFT and end-to-end latency of the streams answered fully before the
                           fault and during its window (`fault_window`), and what the fault added
  served_whole             answers the router marked `X-PDGate-Path: whole` (served without disaggregation)
  stranded_handoffs        READY or CLAIMED records still live once the longest lease chain has passed
                           after the load stopped (must be 0)
  held_blocks              prefill blocks still held then (must be 0)
  recovery_s               from the fault to the end of the last failed request (0: nothing failed)
Recovery is declared when no request has failed for `quiet_s` since the fault was healed and requests
did succeed in that window; every wait is bounded in time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_stack import Procs, Stack, Timing, handoff_gauge, held_blocks

__all__ = ["Ctx", "Knobs", "fault_window", "latency", "read_client_lag", "read_records", "run_scenario", "summarize"]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Knobs:
    """Load and pacing of one run (quick mode shrinks the waits, not the checks)."""

    streams: int = 256
    trickle: float = 4.0
    warmup_s: float = 5.0
    quiet_s: float = 4.0
    max_recover_s: float = 60.0
    stop_s: float = 10.0  # SIGSTOP length
    outage_s: float = 3.0  # Redis / metaserver down time
    partition_s: float = 15.0  # network cut
    prefills_down_s: float = 10.0  # every prefill dead this long (issue 24), in quick mode too
    max_tokens: int = 16
    request_timeout_s: float = 30.0


@dataclass
class Ctx:
    """What a fault function gets: the stack, the knobs, and a place to put what it saw."""

    stack: Stack
    knobs: Knobs
    out: Path
    extra: dict[str, Any] = field(default_factory=dict)
    t_fault: float = 0.0
    t_healed: float = 0.0
    t_before_end: float = 0.0  # when the fault function was called: a fault's own set-up is not "before"

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.out)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # the line being written
            continue
        if "o" in rec:  # the load generator's own last line ({"lag": ...}) is not a request
            recs.append(rec)
    return recs


def read_client_lag(path: Path) -> dict[str, Any]:
    """The load generator's own worst event-loop stall (s) and count of stalls over 0.5 s, once it ended."""
    if not path.exists():
        return {}
    for line in reversed(path.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "lag" in rec:
            return {"client_worst_stall_s": rec["lag"], "client_stalls": rec.get("stalls")}
    return {}


def start_load(
    procs: Procs,
    urls: list[str],
    knobs: Knobs,
    out: Path,
    stop: Path,
    *,
    failover: bool = False,
    cap_s: float = 300,
    per_worker: int | None = None,
    ramp_s: float = 1.0,
) -> Any:
    argv = [sys.executable, str(HERE / "chaos_load.py"), "--out", str(out), "--stop-file", str(stop)]
    argv += ["--streams", str(knobs.streams), "--trickle", str(knobs.trickle), "--duration", str(cap_s)]
    argv += ["--max-tokens", str(knobs.max_tokens), "--request-timeout", str(knobs.request_timeout_s)]
    for u in urls:
        argv += ["--url", u]
    if failover:
        argv.append("--failover")
    argv += ["--ramp-s", str(ramp_s), "--connect-timeout", str(max(5.0, 2 * ramp_s))]
    if per_worker is not None:
        argv += ["--max-per-worker", str(per_worker)]
    return procs.start("load", argv)


def _wait_load_started(ctx: Ctx, deadline: float) -> None:
    while time.time() < deadline:
        if sum(1 for r in ctx.records() if r["o"] == "ok") >= 3:
            return
        time.sleep(0.2)


def _wait_recovered(ctx: Ctx) -> bool:
    """True once nothing failed for quiet_s after the heal and something succeeded in that window."""
    k = ctx.knobs
    deadline = ctx.t_healed + k.max_recover_s
    while time.time() < deadline:
        time.sleep(0.5)
        recs = ctx.records()
        last_err = max((r["t1"] for r in recs if r["o"] != "ok" and r["t1"] >= ctx.t_fault), default=0.0)
        since = max(last_err, ctx.t_healed)
        now = time.time()
        fresh_ok = sum(1 for r in recs if r["o"] == "ok" and r["t0"] >= since)
        if now - since >= k.quiet_s and fresh_ok >= 3:
            return True
    return False


def _wait_settled(stack: Stack, timing: Timing) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """Poll until no handoff is READY/CLAIMED and no prefill holds blocks, up to the longest lease chain."""
    deadline = time.time() + timing.handoff_horizon() + 1.0
    gauge: dict[str, float] | None = None
    held: dict[str, Any] = {}
    while True:
        gauge = handoff_gauge(stack.meta_url)
        held = held_blocks(stack)
        live = None if gauge is None else gauge.get("READY", 0) + gauge.get("CLAIMED", 0)
        if live == 0 and all(v == 0 for v in held.values()):
            return gauge, held
        if time.time() > deadline:
            return gauge, held
        time.sleep(0.25)


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty list."""
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q * len(v)) - 1))]


def _lat(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 TTFT and end-to-end latency in ms of streams answered fully (None when there are none)."""
    e2e = [r["t1"] - r["t0"] for r in recs]
    ttft = [r["ft"] for r in recs if r.get("ft") is not None]
    out: dict[str, Any] = {"n": len(recs)}
    for key, vals in (("ttft", ttft), ("e2e", e2e)):
        for q in (50, 99):
            out[f"{key}_p{q}_ms"] = round(1000 * _pct(vals, q / 100), 1) if vals else None
    return out


def fault_window(recs: list[dict[str, Any]], t_fault: float, t_healed: float, quiet_s: float) -> float:
    """End of the fault window: the fault healed (a process back, an outage over; a kill is healed at once)
    and the last failed request ended, and at least `quiet_s` (the quiet time that declares a recovery)
    after the fault, so a kill that costs no error still has a window for the requests it slowed."""
    last_err = max((r["t1"] for r in recs if r["o"] != "ok" and r["t1"] >= t_fault), default=t_fault)
    return max(t_healed, last_err, t_fault + quiet_s)


def latency(
    recs: list[dict[str, Any]], t_fault: float, t_end: float, t_before_end: float, before_s: float
) -> dict[str, Any]:
    """Latency of the streams answered fully before the fault and during [t_fault, t_end], and the added
    p50/p99 (during minus before). Before: the streams that started and ended in the `before_s` preceding
    the fault (its set-up excluded). During: every stream in flight at some moment of the window."""
    ok = [r for r in recs if r["o"] == "ok" and r["s"]]
    before = _lat([r for r in ok if r["t0"] >= t_before_end - before_s and r["t1"] < t_before_end])
    during = _lat([r for r in ok if r["t1"] >= t_fault and r["t0"] <= t_end])
    added: dict[str, Any] = {}
    for key in ("ttft", "e2e"):
        pair = []
        for q in (50, 99):
            b, d = before[f"{key}_p{q}_ms"], during[f"{key}_p{q}_ms"]
            pair.append(None if b is None or d is None else round(d - b, 1))
        added[f"added_{key}_ms"] = pair  # [p50, p99]
    return {"latency": {"before": before, "during": during, "window_s": round(t_end - t_fault, 2)}, **added}


def summarize(recs: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
    typed = Counter(str(r["c"]) for r in recs if r["o"] == "typed")
    untyped = [r for r in recs if r["o"] == "untyped"]
    errors = [r for r in recs if r["o"] != "ok"]
    last_err = max((r["t1"] for r in errors), default=None)
    return {
        "sent": len(recs),
        "ok": sum(1 for r in recs if r["o"] == "ok"),
        "client_errors": sum(1 for r in recs if r["o"] in ("typed", "untyped")),
        "served_whole": sum(1 for r in recs if r.get("p") == "whole"),
        "streams_sent": sum(1 for r in recs if r["s"]),
        "typed": dict(typed.most_common()),
        "untyped": len(untyped),
        "untyped_examples": [{k: r.get(k) for k in ("s", "st", "c", "d")} for r in untyped[:5]],
        "client_stalled": sum(1 for r in recs if r["o"] == "client"),  # the load generator's, not the stack's
        "client_stalled_examples": [r.get("d") for r in recs if r["o"] == "client"][:3],
        "client_retries": sum(r.get("r", 0) for r in recs),
        "recovery_s": round(max(0.0, last_err - t_fault), 2) if last_err is not None else 0.0,
        "errors_before_fault": sum(1 for r in errors if r["t1"] < t_fault),
    }


def run_scenario(
    name: str,
    title: str,
    fault: Callable[[Ctx], None],
    knobs: Knobs,
    *,
    results_dir: Path,
    routers: int = 1,
    aof: bool = False,
    failover: bool = False,
    timing: Timing | None = None,
    after: Callable[[Ctx], None] | None = None,
    stack_opts: dict[str, Any] | None = None,
    engines_survive: bool = True,
) -> dict[str, Any]:
    """Run one scenario on a fresh stack; every process it started is killed before it returns.
    `engines_survive`: some engine stays up through the fault, so every request must be served (issue 24)."""
    procs = Procs()
    timing = timing or Timing()
    out = results_dir / f"chaos-{name}.jsonl"
    stop = results_dir / f"chaos-{name}.stop"
    for p in (out, stop):
        p.unlink(missing_ok=True)
    row: dict[str, Any] = {"scenario": name, "title": title, "engines_survive": engines_survive}
    t_start = time.time()
    try:
        stack = Stack(procs, timing=timing, routers_n=routers, aof=aof, **(stack_opts or {})).start()
        ctx = Ctx(stack, knobs, out)
        cap = knobs.warmup_s + knobs.stop_s + knobs.outage_s + 2 * knobs.partition_s + knobs.prefills_down_s
        cap += knobs.max_recover_s + 60
        load = start_load(procs, [r.url for r in stack.routers], knobs, out, stop, failover=failover, cap_s=cap)
        _wait_load_started(ctx, time.time() + 30)
        time.sleep(knobs.warmup_s)
        ctx.t_fault = ctx.t_before_end = time.time()
        fault(ctx)
        ctx.t_healed = time.time()
        row["recovered"] = _wait_recovered(ctx)
        stop.touch()
        try:
            load.popen.wait(timeout=knobs.request_timeout_s + 15)
        except subprocess.TimeoutExpired:
            load.kill()
            row["load_killed"] = True
        recs = ctx.records()
        row.update(summarize(recs, ctx.t_fault))
        t_end = fault_window(recs, ctx.t_fault, ctx.t_healed, knobs.quiet_s)
        row.update(latency(recs, ctx.t_fault, t_end, ctx.t_before_end, knobs.warmup_s))
        row.update(read_client_lag(out))
        gauge, held = _wait_settled(stack, timing)
        row["handoffs_live"] = gauge
        row["stranded_handoffs"] = None if gauge is None else int(gauge.get("READY", 0) + gauge.get("CLAIMED", 0))
        row["held_blocks_by_prefill"] = held
        row["held_blocks"] = sum(v for v in held.values() if isinstance(v, int)) if held else 0
        if any(v is None for v in held.values()):
            row["held_blocks"] = None
        if after is not None:
            after(ctx)
        row["checks"] = ctx.extra
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        row["logs"] = str(procs.log_dir)
        procs.close()
        row["pids"] = sorted(set(procs.started))
        stop.unlink(missing_ok=True)
    row["wall_s"] = round(time.time() - t_start, 1)
    row["load_avg"] = round(os.getloadavg()[0], 2)
    return row


def verdict(row: dict[str, Any]) -> bool:
    """The zeros the suite promises, and a recovery; no error at all where an engine survives the fault."""
    return (
        "error" not in row
        and bool(row.get("recovered"))
        and (not row.get("engines_survive", True) or row.get("client_errors") == 0)
        and row.get("untyped") == 0
        and row.get("stranded_handoffs") == 0
        and row.get("held_blocks") == 0
        and all(v for k, v in row.get("checks", {}).items() if k.startswith("ok_"))
    )

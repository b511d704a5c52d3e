"""The listing and acting commands of `pdgate`: instances, handoffs, drain, undrain, top, config.

Each takes the settings and the command's own arguments, and returns what to print; `main` prints it.
An instance row joins the metaserver's record (role, state, the engine's reported load and KV use) with
the router's view of it (available, breaker, requests in flight), by id.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from pdgate.cli.client import Admin, Samples
from pdgate.cli.render import emit, table
from pdgate.cli.settings import CliSettings

from pdgate.histo import quantile, window

__all__ = ["PHASES", "config", "drain", "handoffs", "instance_rows", "instances", "phase_latencies", "top"]

INSTANCE_COLUMNS = ("id", "role", "model", "state", "url", "running", "waiting", "kv_use", "inflight", "breaker")
# The router's phase histograms (router/metrics.py) and what its clients wait for (router/client_timing.py:
# time to first token, time per output token), as `top` shows them.
PHASES = ("ttft", "tpot", "overhead", "handoff", "prefill", "decode_ttft", "e2e")
Histograms = dict[str, list[tuple[float, float]]]


def instance_rows(admin: Admin, role: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
    """The registry's instances, each with the router's view when a router is configured."""
    found = admin.instances(role, state)
    pool: dict[str, dict[str, Any]] = {}
    if admin.s.router is not None:
        pool = {r["id"]: r for r in admin.router_health().get("instances", [])}
    rows = []
    for inst in found:
        load = inst.get("load") or {}
        seen = pool.get(inst["id"], {})
        rows.append(
            {
                "id": inst["id"],
                "role": inst["role"],
                "model": inst["model"],
                "state": inst["state"],
                "url": inst["url"],
                "running": load.get("running"),
                "waiting": load.get("waiting"),
                "kv_use": f"{100 * float(load.get('kv_usage', 0.0)):.0f}%",
                "inflight": seen.get("inflight"),
                "breaker": seen.get("breaker"),
                "available": seen.get("available"),
                "reason": seen.get("reason"),
            }
        )
    return rows


def instances(admin: Admin, args: argparse.Namespace) -> str:
    rows = instance_rows(admin, args.role, args.state)
    return emit(admin.s.output, rows, rows, INSTANCE_COLUMNS)


HANDOFF_COLUMNS = ("transfer_id", "state", "prefill_instance_id", "decode_instance_id", "age_s", "lease_left_s")


def handoffs(admin: Admin, args: argparse.Namespace) -> str:
    """One handoff by id; the live handoffs by state (`--counts`: the metaserver's gauge, every record
    counted); or the live records themselves (`--state`, `--limit`; the nearest lease end first)."""
    if args.transfer_id:
        h = admin.handoff(args.transfer_id)
        rows = [{k: v for k, v in h.items() if not isinstance(v, dict | list)}]
        return emit(admin.s.output, h, rows, list(rows[0]))
    if args.counts:
        counts = admin.handoff_counts()
        if args.state:
            counts = {k: v for k, v in counts.items() if k == args.state}
        rows = [{"state": k, "count": v} for k, v in sorted(counts.items())]
        return emit(admin.s.output, counts, rows, ("state", "count"))
    found = admin.handoffs(args.state, args.limit)
    now = time.time()
    rows = [
        {
            **h,
            "age_s": round(now - h["created_at"], 1),
            "lease_left_s": round(h["deadline"] - now, 1) if h.get("deadline") else None,
        }
        for h in found
    ]
    return emit(admin.s.output, found, rows, HANDOFF_COLUMNS)


def drain(admin: Admin, args: argparse.Namespace) -> str:
    inst = admin.set_drain(args.instance_id, args.command == "drain")
    row = {"id": inst["id"], "role": inst["role"], "state": inst["state"], "url": inst["url"]}
    return emit(admin.s.output, inst, [row], ("id", "role", "state", "url"))


def histograms(samples: Samples) -> Histograms:
    """The router's phase histograms as cumulative buckets, by phase."""
    out: Histograms = {}
    for phase in PHASES:
        name = f"pdgate_router_{phase}_seconds_bucket"
        buckets = [(float(dict(lb)["le"]), v) for (n, lb), v in samples.items() if n == name]
        out[phase] = sorted(buckets, key=lambda b: b[0])
    return out


def phase_latencies(now: Histograms, before: Histograms | None) -> list[dict[str, Any]]:
    """p50/p95/p99 (ms) and count of each phase between two readings (since start without `before`)."""
    rows = []
    for phase, buckets in now.items():
        w = window(buckets, (before or {}).get(phase))
        row: dict[str, Any] = {"phase": phase, "count": int(w[-1][1]) if w else 0}
        for q in (0.5, 0.95, 0.99):
            v = quantile(q, w)
            row[f"p{round(q * 100)}_ms"] = None if v is None or math.isinf(v) else round(v * 1000, 2)
        rows.append(row)
    return rows


def _top_once(admin: Admin, before: Histograms | None) -> tuple[str, dict[str, Any], Histograms]:
    rows = instance_rows(admin)
    hist = histograms(admin.metrics("router")) if admin.s.router else {}
    phases = phase_latencies(hist, before)
    data = {"instances": rows, "phases": phases}
    cols = ("id", "role", "state", "running", "waiting", "kv_use", "inflight", "breaker", "available")
    text = table(rows, cols) if rows else "(no instance registered)"
    if phases:
        text += "\n\n" + table(phases, ("phase", "count", "p50_ms", "p95_ms", "p99_ms"))
    return text, data, hist


def top(admin: Admin, args: argparse.Namespace) -> str:
    """Live load, queue, KV use, breaker and phase latencies, redrawn every --interval seconds (latencies
    over the last interval); `--once` prints one screen (latencies since the router started) and returns."""
    text, data, hist = _top_once(admin, None)
    if args.once:
        return emit(admin.s.output, data, [], ()) if admin.s.output == "json" else text
    window = "since the router started"
    while True:
        head = f"{time.strftime('%H:%M:%S')}  {admin.s.router or admin.s.meta_url}  (latencies {window})"
        print("\x1b[H\x1b[2J" + head + "\n\n" + text, flush=True)
        time.sleep(args.interval)
        text, data, hist = _top_once(admin, hist)
        window = f"over the last {args.interval:g} s"


def config(s: CliSettings, path: Path | None) -> str:
    """The settings as read (tokens shown as set or not) and the file they came from."""
    data: dict[str, Any] = s.model_dump()
    for k in ("token", "metaserver_token"):
        data[k] = "(set)" if data[k] else None
    data["config"] = str(path) if path else None
    if s.output == "json":
        return emit("json", data, [], ())
    return table([{"setting": k, "value": v} for k, v in data.items()], ("setting", "value"))

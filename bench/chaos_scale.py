"""Scale: thousands of concurrent streams through one router, its memory per open stream and its fds.

The decodes stream slowly (a token every few seconds) so that every stream stays open at once; each client
sends exactly one request. The router's RSS and open file descriptors are sampled from /proc while the
load runs, with its own in-flight gauge, so the per-stream figure divides by the streams really open in
the router at the sample with the most.

What the load generator causes is reported apart from what the stack causes: with thousands of clients in
one Python process on a small, busy machine, the client itself can stall for longer than the router's
header timeout between connecting and sending its request. The router then answers a typed 408
`request_timeout` (`client_408`), and a connection error during such a stall of the client is the
client's (`client_stalled`, see chaos_load.py); the client's own worst stall is in `client_worst_stall_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from chaos_run import Knobs, read_client_lag, read_records, start_load, summarize
from chaos_stack import Procs, Stack, Timing

__all__ = ["run_scale"]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _inflight(url: str) -> int:
    """The router's own count of requests in flight (its /metrics gauge)."""
    try:
        for line in httpx.get(url + "/metrics", timeout=5.0).text.splitlines():
            if line.startswith("pdgate_router_inflight "):
                return int(float(line.split()[1]))
    except httpx.HTTPError:
        pass
    return -1


def _router_footprint(samples: list[tuple[int, float, int]], idle_rss: float, idle_fds: int) -> dict[str, Any]:
    """The router's memory and descriptors at the sample with the most streams open (the larger RSS among
    equals), against idle."""
    peak_open, rss, fds = max(samples, default=(0, idle_rss, idle_fds), key=lambda s: (s[0], s[1]))
    return {
        "peak_open_streams": peak_open,
        "router_rss_idle_mb": round(idle_rss, 1),
        "router_rss_peak_mb": round(rss, 1),
        "router_rss_mb_per_1k_streams": round((rss - idle_rss) / peak_open * 1000, 1) if peak_open else None,
        "router_fds_idle": idle_fds,
        "router_fds_at_peak": fds,
        "router_max_rss_mb": round(max((s[1] for s in samples), default=idle_rss), 1),
    }


def run_scale(
    streams: int,
    results_dir: Path,
    *,
    tokens: int = 10,
    token_delay_s: float = 8.0,
    ramp_s: float = 40.0,
    load_procs: int = 4,
) -> dict[str, Any]:
    procs = Procs()
    # Thousands of handoffs in flight on a small machine: the ledger gets its default leases and timeout,
    # and tokens are few and far apart, so that the CPU goes to holding streams open, not to tokens.
    timing = Timing(
        pending_lease_s=60.0,
        ready_lease_s=30.0,
        claim_lease_s=10.0,
        token_delay_s=token_delay_s,
        stream_idle_timeout_s=2 * token_delay_s + 10.0,
        decode_timeout_s=60.0,
        prefill_timeout_s=60.0,
        metaserver_timeout_s=5.0,
        claim_wait_s=30.0,
    )
    out = results_dir / "chaos-scale.jsonl"
    stop = results_dir / "chaos-scale.stop"
    for p in (out, stop):
        p.unlink(missing_ok=True)
    row: dict[str, Any] = {"scenario": "scale", "title": f"{streams} concurrent streams through one router"}
    row["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    row["uptime_start"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    t_start = time.time()
    ramp = ramp_s
    try:
        stack = Stack(procs, timing=timing).start()
        router = stack.routers[0]
        time.sleep(1.0)
        idle_rss, idle_fds = _rss_mb(router.pid), _fds(router.pid)
        knobs = Knobs(
            streams=streams, trickle=0.0, max_tokens=tokens, request_timeout_s=ramp_s + tokens * token_delay_s + 60
        )
        # Several load processes, each with its share of the streams: one Python process with thousands
        # of streams stalls for tens of seconds on a busy 2-core machine (its own event loop's backlog),
        # and its requests then fail for the client's sake, not the router's.
        parts = [
            (out.with_name(f"chaos-scale.{i}.jsonl"), streams // load_procs + (i < streams % load_procs))
            for i in range(load_procs)
        ]
        loads = [
            start_load(procs, [router.url], replace(knobs, streams=n), path, stop, cap_s=600, per_worker=1, ramp_s=ramp)
            for path, n in parts
        ]
        samples: list[tuple[int, float, int]] = []
        deadline = time.time() + ramp_s + tokens * token_delay_s + 120
        while any(load.alive for load in loads) and time.time() < deadline:
            samples.append((_inflight(router.url), _rss_mb(router.pid), _fds(router.pid)))
            time.sleep(0.5)
        for load in loads:
            if load.alive:
                load.kill()
                row["load_killed"] = True
        recs = [r for path, _ in parts for r in read_records(path)]
        out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
        row.update(summarize(recs, t_start))
        lags = [read_client_lag(path) for path, _ in parts]
        row["load_procs"] = load_procs
        row["client_worst_stall_s"] = max((lag.get("client_worst_stall_s") or 0.0 for lag in lags), default=None)
        row["client_stalls"] = sum(lag.get("client_stalls") or 0 for lag in lags)
        # Answered 408 because this client sent its request later than the router's header timeout: the
        # router's typed answer to a starved client, counted apart from the stack's own errors.
        row["client_408"] = sum(1 for r in recs if r["o"] == "typed" and r.get("c") == "request_timeout")
        row.update(_router_footprint(samples, idle_rss, idle_fds))
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        row["logs"] = str(procs.log_dir)
        procs.close()
    row["wall_s"] = round(time.time() - t_start, 1)
    row["load_avg"] = round(os.getloadavg()[0], 2)
    row["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return row

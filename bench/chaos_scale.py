"""Scale: thousands of concurrent streams through one router, its memory per open stream and its fds.

The decodes stream slowly (one token a second) so that every stream stays open at once; each client
sends exactly one request. The router's RSS and open file descriptors are sampled from /proc while the
load runs; the number of streams open at each sample is counted afterwards from the requests' start and
end times, so the per-stream figure uses the streams really open at the sample with the most.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from chaos_run import Knobs, read_records, start_load, summarize
from chaos_stack import Procs, Stack, Timing

__all__ = ["run_scale"]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def run_scale(streams: int, results_dir: Path, *, tokens: int = 20, token_delay_s: float = 1.0) -> dict[str, Any]:
    procs = Procs()
    timing = Timing(token_delay_s=token_delay_s, stream_idle_timeout_s=10.0, decode_timeout_s=60.0)
    out = results_dir / "chaos-scale.jsonl"
    stop = results_dir / "chaos-scale.stop"
    for p in (out, stop):
        p.unlink(missing_ok=True)
    row: dict[str, Any] = {"scenario": "scale", "title": f"{streams} concurrent streams through one router"}
    t_start = time.time()
    try:
        stack = Stack(procs, timing=timing).start()
        router = stack.routers[0]
        time.sleep(1.0)
        idle_rss, idle_fds = _rss_mb(router.pid), _fds(router.pid)
        knobs = Knobs(streams=streams, trickle=0.0, max_tokens=tokens, request_timeout_s=tokens * token_delay_s + 60)
        load = start_load(procs, [router.url], knobs, out, stop, cap_s=600, per_worker=1)
        samples: list[tuple[float, float, int]] = []
        deadline = time.time() + tokens * token_delay_s + 120
        while load.alive and time.time() < deadline:
            samples.append((time.time(), _rss_mb(router.pid), _fds(router.pid)))
            time.sleep(0.5)
        if load.alive:
            load.kill()
            row["load_killed"] = True
        recs = read_records(out)
        row.update(summarize(recs, t_start))
        best = (0, idle_rss, idle_fds)
        for t, rss, fds in samples:
            open_now = sum(1 for r in recs if r["t0"] <= t < r["t1"])
            if open_now > best[0]:
                best = (open_now, rss, fds)
        peak_open, rss, fds = best
        row["peak_open_streams"] = peak_open
        row["router_rss_idle_mb"] = round(idle_rss, 1)
        row["router_rss_peak_mb"] = round(rss, 1)
        row["router_rss_mb_per_1k_streams"] = round((rss - idle_rss) / peak_open * 1000, 1) if peak_open else None
        row["router_fds_idle"] = idle_fds
        row["router_fds_at_peak"] = fds
        row["router_max_rss_mb"] = round(max((s[1] for s in samples), default=idle_rss), 1)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        row["logs"] = str(procs.log_dir)
        procs.close()
    row["wall_s"] = round(time.time() - t_start, 1)
    row["load_avg"] = os.getloadavg()[0]
    return row

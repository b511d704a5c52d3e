"""Chaos suite: faults under load against a real pdgate stack, with the numbers users need (issue 10).

Each scenario starts a fresh stack (Redis through tests.support.redis, a metaserver process, one or two
routers, 2 prefill + 2 decode `pdgate-sim`s that move every handoff through the ledger), puts N
concurrent streaming clients plus a trickle of non-streaming ones on it (official `openai` client, see
chaos_load.py), injects one fault at a known time and keeps the load on until the error rate is back to
zero. Then it checks what must be zero: errors seen by clients, typed or not, in every scenario where an
engine survives the fault (issue 24: a fault costs latency, never an error), untyped failures, handoffs
left READY/CLAIMED past their leases, prefill blocks still held; and what the fault cost: p50/p99 time to
first token and end-to-end latency during the fault window against before the fault. Scale: thousands
of concurrent streams through one router, its RSS per 1,000 open streams and its open fds.

Prints a table, writes bench/results/chaos.json (chaos-quick.json with --quick) and, unless --no-docs,
docs/RELIABILITY.md (generated from the results; never edit it by hand). Every process it starts is
killed by PID when it ends, also on Ctrl-C or SIGTERM. Exit status 1 when a zero was not met.

    .venv-vllm/bin/python bench/chaos.py [--quick] [--streams 256] [--only 1 3 4a 9] [--no-scale] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos_faults import SCENARIOS  # noqa: E402
from chaos_report import render_markdown, render_table  # noqa: E402
from chaos_run import Knobs, run_scenario, verdict  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS = ROOT / "docs" / "RELIABILITY.md"

# Quick mode's warm-up is 4 s: on a loaded 2-core machine a wave of 64 streams takes over a second, and 2 s
# left as few as 4 streams started and finished before the fault for the added-latency baseline.
QUICK = Knobs(
    streams=64, trickle=2.0, warmup_s=4.0, quiet_s=2.0, max_recover_s=30.0, stop_s=5.0, outage_s=2.0, partition_s=6.0
)
FULL = Knobs(
    streams=256, trickle=4.0, warmup_s=5.0, quiet_s=4.0, max_recover_s=60.0, stop_s=10.0, outage_s=3.0, partition_s=15.0
)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`, which kills what was started


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def scale_pass(s: dict[str, Any], streams: int) -> bool:
    """No error of the stack: every stream answered fully, except those the load generator itself failed
    (a typed 408 to a client that sent its request late, or a connection error while it was stalled)."""
    own = s.get("ok", 0) + s.get("client_408", 0) + s.get("client_stalled", 0)
    typed_other = sum(n for c, n in (s.get("typed") or {}).items() if c != "request_timeout")
    return "error" not in s and s.get("untyped") == 0 and typed_other == 0 and own == streams


def _selected(only: list[str] | None) -> list[str]:
    names = [*SCENARIOS, "7-partition"]
    if not only:
        return names
    return [n for n in names if any(n.split("-")[0] == o or n == o for o in only)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    knobs = QUICK if args.quick else FULL
    if args.streams:
        knobs = Knobs(**{**knobs.__dict__, "streams": args.streams})
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    for name in _selected(args.only):
        print(f"== {name}", flush=True)
        if name == "7-partition":
            from chaos_netns import run_partition

            row = run_partition(knobs, RESULTS)
        else:
            title, fault, opts = SCENARIOS[name]
            row = run_scenario(name, title, fault, knobs, results_dir=RESULTS, **opts)
        row["pass"] = verdict(row) if not row.get("skipped") else None
        rows.append(row)
        print(render_table([row]), flush=True)
    scale = None
    if not args.no_scale and not args.only:
        from chaos_scale import run_scale

        print(f"== scale ({args.scale_streams} streams)", flush=True)
        scale = run_scale(args.scale_streams, RESULTS)
        scale["pass"] = scale_pass(scale, args.scale_streams)
    return {
        "mode": "quick" if args.quick else "full",
        "knobs": knobs.__dict__,
        "timing": __import__("chaos_stack").Timing().as_dict(),
        "rows": rows,
        "scale": scale,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "uptime_start": uptime_start,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip(),
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="64 streams, shorter waits and outages")
    p.add_argument("--streams", type=int, default=0, help="concurrent streaming clients (default 256, quick 64)")
    p.add_argument("--only", nargs="*", help="scenario numbers or names, e.g. 1 3 4a (skips scale)")
    p.add_argument("--no-scale", action="store_true")
    p.add_argument("--scale-streams", type=int, default=4096)
    p.add_argument("--scale-only", action="store_true", help="rerun scale into the existing results JSON")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/RELIABILITY.md")
    p.add_argument("--render-only", action="store_true", help="rewrite docs/RELIABILITY.md from the results JSON")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/chaos[-quick].json)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _raise_fd_limit()
    out = args.out or RESULTS / ("chaos-quick.json" if args.quick else "chaos.json")
    if args.render_only:
        DOCS.write_text(render_markdown(json.loads(out.read_text())))
        print(f"wrote {DOCS} from {out}")
        return 0
    if args.scale_only:
        from chaos_scale import run_scale

        result = json.loads(out.read_text())
        result["scale"] = run_scale(args.scale_streams, RESULTS)
        s = result["scale"]
        s["pass"] = scale_pass(s, args.scale_streams)
    else:
        result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print()
    print(render_table(result["rows"], result["scale"]))
    print(f"results: {out}")
    if not args.no_docs:
        DOCS.write_text(render_markdown(result))
        print(f"wrote {DOCS}")
    failed = [r["scenario"] for r in result["rows"] if r.get("pass") is False]
    if result["scale"] is not None and not result["scale"].get("pass"):
        failed.append("scale")
    if failed:
        print("FAILED: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the PDGateConnector costs an engine on requests it does not transfer: plain vLLM against the
connector's prefill and decode engines, each asked directly (no router), the same whole requests.

Why: conditional disaggregation keeps most requests whole on the PD engines, so the connector's per-step
hooks run on every step of every request, and the goodput comparison with colocated replicas (plain
engines) sees whatever they cost. A py-spy profile of the decode's engine core under 8 concurrent
requests found 7.4 % of its samples in the load report's thread hand-off (`call_soon_threadsafe`'s
wake-up write, then the GIL back from the woken control thread), once per step.

Setups as bench/goodput.py starts them (bench/goodput_setups.py): two plain replicas and pdgate's 1P1D
engines, one engine's OMP threads per core, the same flags. Each round asks every engine in turn (the
order reverses each round) for `--prompts` W3-like prompts (50-2,000 random token ids, 64 out,
`--ignore-eos`) at `--concurrency` with `vllm bench serve`; only one engine has load at a time. The
table gives each engine's requests/s, TTFT and TPOT p50 (medians over the rounds), and the ratio of the
connector engines to the plain ones, round by round (paired in time: the host's speed drifts).

    .venv-vllm/bin/python bench/engine_overhead.py [--rounds 4] [--prompts 48] [--concurrency 8]

Writes bench/results/engine-overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from goodput_plan import Slo, rescore
from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR

RESULTS = Path(__file__).resolve().parent / "results"
UNBOUNDED = Slo(float("inf"), float("inf"))


def _say(msg: str) -> None:
    print(f"[bench/engine_overhead] {msg}", flush=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from goodput import Datasets, offline_loopback_env
    from goodput_run import bench_serve, serve_argv
    from goodput_setups import Context, Serving
    from pdgate.deploy.local.vllm_instance import ServeFlags

    offline_loopback_env()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdgate-bench-engine-overhead-")).resolve()
    flags = ServeFlags(model_dir=args.model_dir)
    ctx = Context(args.model_dir, run_dir, None, flags, lambda: flags.max_model_len, _say)
    data = Datasets(args.model_dir, run_dir / "datasets")
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with Serving(("colocated", "pd"), ctx, lambda name, exc: _say(f"{name} failed: {exc}")) as serving:
        colocated, pd = serving.get("colocated"), serving.get("pd")
        if colocated is None or pd is None:
            raise SystemExit("the engines did not start (see the run dir's logs)")
        engines = {f"plain-{i}": url for i, url in enumerate(colocated.engine_urls)}
        engines.update({f"pdgate-{name}": url for name, url in zip(pd.engines, pd.engine_urls, strict=True)})
        for name, url in engines.items():  # one-off costs of a fresh engine, unscored
            ds, out = data.file("W2", 8, -2, name), run_dir / f"warm-{name}.json"
            bench_serve(
                serve_argv(url, args.model_dir, ds, 8, out, None, rate=float("inf"), concurrency=4),
                out.with_suffix(".log"),
            )
        order = list(engines)
        for k in range(args.rounds):
            for name in order if k % 2 == 0 else reversed(order):
                ds, out = data.file("W3", args.prompts, 3000 + k, name), run_dir / f"{name}-{k}.json"
                argv = serve_argv(
                    engines[name], args.model_dir, ds, args.prompts, out, None,
                    rate=float("inf"), concurrency=args.concurrency,
                )  # fmt: skip
                res = bench_serve(argv, out.with_suffix(".log"))
                s = rescore(res, UNBOUNDED)
                row = {
                    "engine": name,
                    "round": k,
                    "complete": s["complete"],
                    "duration_s": res["duration"],
                    "rps": s["complete"] / res["duration"],
                    "ttft_p50_ms": s["ttft_ms"]["p50"],
                    "tpot_p50_ms": s["tpot_ms"]["p50"],
                }
                rows.append(row)
                _say(f"round {k} {name}: {row['rps']:.2f} req/s, TPOT p50 {row['tpot_p50_ms']:.2f} ms")
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() - (time.monotonic() - t0))),
        "wall_s": time.monotonic() - t0,
        "config": {"rounds": args.rounds, "prompts": args.prompts, "concurrency": args.concurrency},
        "loadavg_after": os.getloadavg(),
        "rows": rows,
    }


def ratios(result: dict[str, Any]) -> list[float]:
    """The connector's engines' mean req/s over the plain ones', one ratio per round (paired in time)."""
    rows = result["rows"]
    out = []
    for k in sorted({r["round"] for r in rows}):
        plain = [r["rps"] for r in rows if r["round"] == k and r["engine"].startswith("plain")]
        conn = [r["rps"] for r in rows if r["round"] == k and r["engine"].startswith("pdgate")]
        if plain and conn:
            out.append(statistics.mean(conn) / statistics.mean(plain))
    return out


def summary(result: dict[str, Any]) -> list[str]:
    """The table: per engine the medians over rounds; then connector / plain, paired round by round."""
    rows = result["rows"]
    names = list(dict.fromkeys(r["engine"] for r in rows))
    out = ["| engine | req/s (median) | TTFT p50 ms | TPOT p50 ms | rounds |", "|---|---:|---:|---:|---:|"]
    for n in names:
        mine = [r for r in rows if r["engine"] == n]
        out.append(
            f"| {n} | {_median([r['rps'] for r in mine]):.2f} | {_median([r['ttft_p50_ms'] for r in mine]):.0f} "
            f"| {_median([r['tpot_p50_ms'] for r in mine]):.2f} | {len(mine)} |"
        )
    if rs := ratios(result):
        rng = f"{min(rs):.2f}-{max(rs):.2f}"
        out += ["", f"pdgate engines / plain engines, req/s: median of {len(rs)} rounds {_median(rs):.2f}x ({rng})"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=48, help="requests per engine per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--run-dir", default=None, help="logs, datasets and vLLM's raw results")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine-overhead.json")
    args = ap.parse_args(argv)
    result = run(args)
    lines = summary(result)
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    _say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

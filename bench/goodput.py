"""Goodput of PD disaggregation against colocated replicas on the same cores (issue #22 item 1).

Four setups, one after another, each with the same two cores (one engine's OMP threads per core), the
same model and the same engine flags, pdgate-router in front of all (bench/goodput_setups.py):
colocated (2 plain vLLM replicas, role both, served whole), pdgate PD (1P1D), pdgate conditional
(`--disaggregation conditional`, the same engines) and vLLM's NixlConnector 1P1D. Workloads
(bench/goodput_plan.py): W1 long prompts (~2,048 tokens), W2 short chat (128 in), W3 mixed (50-2,000 in),
W4 multi-turn conversations sharing a growing prefix, all 64 tokens out, and the seed's burst case
(256 requests at once). Prompts are uniformly random token ids (vLLM's custom dataset, never its
`random` one, whose prompts share prefixes on a small vocabulary).

Per workload the colocated setup is first measured unloaded (one request at a time): TTFT SLO = 4x its
TTFT p50, TPOT SLO = 3x its TPOT p50, and its capacity unloaded sets the rate ladder every setup runs
(`vllm bench serve`, Poisson arrivals, `--goodput`, `--save-result --save-detailed`; bench/goodput_run.py).
Each point is re-scored from the per-request results (a stream cut after its first token is not good),
with the load average and the cores' busy share during it and the router's phase histograms. The ladder
grows while the SLOs still hold, and the best point is run again.

The conditional setup runs after colocated and PD, on the PD engines, at the threshold this run measured:
the prompt length from which PD met the SLOs at least as often as colocated (bench/goodput_threshold.py),
or max-model-len when PD paid at no length, so it disaggregates only where this hardware showed it pays.
`--pd-min-tokens N` runs it at N instead.

Writes bench/results/goodput.json (goodput-quick.json with --quick) and, unless --no-docs,
docs/PERFORMANCE.md (generated from the results by bench/goodput_report.py; never edit it by hand).

    .venv-vllm/bin/python bench/goodput.py [--setups colocated pd conditional nixl] [--workloads W1 W2 W3 W4 burst]
    .venv-vllm/bin/python bench/goodput.py --dry-run            # the plan and its time estimate, no engine
    .venv-vllm/bin/python bench/goodput.py --quick              # CI: the decider takes both paths, outputs equal
    .venv-vllm/bin/python bench/goodput.py --render-only        # docs/PERFORMANCE.md from the saved results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

from goodput_plan import (  # noqa: E402
    BURST_RUNS,
    LOW_SHARE,
    MODES,
    REPEAT_SHARE,
    REPORT_FRESH_S,
    SETTLE_S,
    SETUPS,
    SHARED_ENGINES,
    WORKLOADS,
    Plan,
    Slo,
    capacity,
    cells,
    dataset_texts,
    plan_lines,
    point_s,
    prompts_for,
    remaining_s,
    slo_from_unloaded,
    write_dataset,
)
from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR  # noqa: E402
from pdgate.router.decider import DeciderConfig  # noqa: E402

RESULTS = HERE / "results"
DOCS = REPO / "docs" / "PERFORMANCE.md"
MULTITURN = RESULTS / "multiturn.json"  # bench/multiturn.py's W4 run on 2P2D, rendered beside this one
OVERHEAD = RESULTS / "engine-overhead.json"  # bench/engine_overhead.py's run, rendered beside this one
GOOD_SHARE = 0.9  # a point whose good/sent is at least this still meets the SLOs: the ladder may grow


def _say(msg: str) -> None:
    print(f"[bench/goodput] {msg}", flush=True)


class Datasets:
    """Fresh prompts for every point and every setup (seeded by workload, point and setup): a prompt seen
    before would be served partly from the prefix cache, and `conditional` runs on `pd`'s engines (the first
    full run gave it pd's own prompts: 94-99 % cache hits on W1). Each setup draws from the same
    distribution."""

    def __init__(self, model_dir: Path, folder: Path) -> None:
        self.model_dir, self.folder = model_dir, folder
        self.tok: Any = None  # loaded on the first dataset written

    def file(self, workload: str, n: int, seed: int, setup: str = "") -> Path:
        if self.tok is None:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        if setup:
            seed = zlib.crc32(f"{setup}:{seed}".encode()) % 1_000_000_007
        path = self.folder / f"{workload}-{seed}-{n}.jsonl"
        if not path.exists():

            def encode(text: str) -> list[int]:
                return list(self.tok(text, add_special_tokens=False).input_ids)

            def decode(ids: list[int]) -> str:
                return str(self.tok.decode(ids))

            write_dataset(path, dataset_texts(workload, n, seed, len(self.tok), encode, decode))
        return path


def offline_loopback_env() -> None:
    """Offline (the tokenizer is local) and never through a proxy to the loopback setups."""
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(
        x for x in ("127.0.0.1,localhost", os.environ.get("NO_PROXY", "")) if x
    )


def cpu_model() -> str:
    """The processor and the vector extensions vLLM's CPU kernels use: a bfloat16 engine runs several times
    slower without AVX-512 (BF16) or AMX, so absolute numbers from two hosts differ by that much."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


class Sweep:
    """Runs the plan's cells in order (`goodput_plan.cells`): at each rate every setup of the cell runs one
    point, in an order that rotates, before the next rate. SLOs and ladders come from the first setup."""

    def __init__(self, plan: Plan, args: argparse.Namespace, run_dir: Path, result: dict[str, Any]) -> None:
        self.plan, self.args, self.run_dir, self.result = plan, args, run_dir, result
        self.data = Datasets(args.model_dir, run_dir / "datasets")
        self.deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else float("inf")
        self.skipped: list[str] = []
        self.never = 0  # a prompt length no request reaches (max-model-len), set by `run`
        self._turn = 0  # rotates the order setups take within a round
        self._last = ""  # the setup of the point run last (`SHARED_ENGINES`)
        self.runner: Callable[..., dict[str, Any]] | None = None  # goodput_run.run_point unless a test's

    def run(self, serving: Any) -> None:
        warmed: set[str] = set()
        for index, cell in enumerate(cells(self.plan)):
            runs = {s: r for s in cell.setups if (r := serving.get(s)) is not None}
            for name, r in runs.items():
                if name not in warmed:
                    self._warm(r)
                    warmed.add(name)
            if not runs:
                continue
            t0 = time.monotonic()
            self._cell(index, cell.workload, runs, serving)
            for name, r in runs.items():
                entry = self._entry(name)
                entry["wall_s"] = entry.get("wall_s", 0.0) + (time.monotonic() - t0) / len(runs)
                if name in serving.runs:
                    entry["pinning"] = r.pinning()  # read while it runs: a later group stops it
            self._save()
        if self.args.quick and (cond := serving.get("conditional")) is not None:
            from goodput_quick import decider_check

            self.result["quick_check"] = decider_check(cond, self.pd_min_tokens())
        self._save()

    def _entry(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.result["setups"].setdefault(name, {"label": SETUPS[name], "workloads": {}})
        return entry

    def _points(self, name: str, w: str) -> list[dict[str, Any]]:
        points: list[dict[str, Any]] = self._entry(name)["workloads"].setdefault(w, {"points": []})["points"]
        return points

    def _cell(self, index: int, w: str, runs: dict[str, Any], serving: Any) -> None:
        if self.runner is None:
            from goodput_run import run_point

            self.runner = run_point
        run_point = self.runner
        slo, cap = self._slo(next(iter(runs.values())), w)
        wl = WORKLOADS[w]
        mode = self.plan.mode
        live = dict(runs)
        climbing = list(runs)  # setups whose last point met the SLOs for at least LOW_SHARE of it

        def point(name: str, rate: float) -> None:
            if name not in live:
                return
            points = self._points(name, w)
            out = self.run_dir / name / w
            out.mkdir(parents=True, exist_ok=True)
            k = len(points)
            n = wl.burst or prompts_for(rate, mode)
            ds = self.data.file(w, n, 1000 + k if wl.burst else k, name)
            if name != self._last and {name, self._last} <= SHARED_ENGINES:
                time.sleep(REPORT_FRESH_S)  # the other router's load has left the engines' reports
            self._last = name
            try:
                p = run_point(
                    live[name], self.args.model_dir, ds, out / f"point-{k}.json", slo, n=n, rate=rate,
                    concurrency=wl.burst,
                )  # fmt: skip
            except Exception as exc:  # the setup is left out from here on; the others go on
                serving.fail(name, exc)
                del live[name]
                return
            p["repeat"] = any(q["rate"] == rate for q in points)
            p["beside"] = [s for s in runs if s != name]  # the setups that took turns with it
            points.append(p)
            if p["good"] < LOW_SHARE * p["sent"] and name in climbing:
                climbing.remove(name)
            _say(f"{name} {w} {rate:.2f} req/s: good {p['good']}/{p['sent']}, goodput {p['goodput']:.2f}")

        def round_(todo: list[tuple[str, float]]) -> None:
            k = self._turn % max(len(todo), 1)
            self._turn += 1
            for name, rate in todo[k:] + todo[:k]:
                point(name, rate)

        def fits(what: str, points: int = 0) -> bool:
            """An optional round of `points` points (default one per live setup) runs while it and the
            mandatory rest fit the budget (`--budget-min`)."""
            left = self.deadline - time.monotonic() - remaining_s(self.plan, index)
            if left >= (points or len(live)) * point_s(mode, w):
                return True
            self.skipped.append(f"{'/'.join(runs)} {w}: {what} (budget)")
            return False

        if wl.burst:
            for _ in range(BURST_RUNS):
                round_([(name, float("inf")) for name in runs])
        else:
            self._ladder(w, [f * cap for f in mode.rate_factors], live, climbing, round_, fits)
        for name in runs:
            if points := self._points(name, w):
                _say(f"{name} {w}: best goodput {max(p['goodput'] for p in points):.2f} req/s")

    def _ladder(
        self,
        w: str,
        rates: list[float],
        live: dict[str, Any],
        climbing: list[str],
        round_: Callable[[list[tuple[str, float]]], None],
        fits: Callable[..., bool],
    ) -> None:
        """The rates in turn (a setup that met the SLOs for under LOW_SHARE of a point's requests stops:
        higher rates only queue more), growth while a setup's last rate met them, then the repeats: each
        setup's best rate again where one run is all it has there and the call is close (REPEAT_SHARE of
        colocated's), and colocated's best rate again on every setup that ran it. The last is what the
        targets compare: a setup's one unlucky run at the rate where colocated averages two or three said
        0.29x on W3 (stop 35's run) where paired runs of the same two setups said 0.90-0.98x."""
        mode = self.plan.mode
        for rate in rates:
            round_([(s, rate) for s in climbing])
        for _ in range(mode.extend):
            grow = []
            for s in climbing:
                last = self._points(s, w)[-1]
                if last["good"] >= GOOD_SHARE * last["sent"]:
                    grow.append((s, last["rate"] * 2))
            if not grow or not fits("growth"):
                break
            round_(grow)
        colocated = self._points("colocated", w) if "colocated" in self.result["setups"] else []
        bar = REPEAT_SHARE * max((p["goodput"] for p in colocated), default=0.0)
        for _ in range(mode.repeats):
            paired = max(colocated, key=lambda q: q["goodput"])["rate"] if colocated else None
            todo = []
            for s in live:
                points = self._points(s, w)
                top = max(points, key=lambda q: q["goodput"])
                rates = [top["rate"]] if top["goodput"] >= bar else []
                if paired is not None and paired not in rates and any(q["rate"] == paired for q in points):
                    rates.append(paired)
                todo += [(s, r) for r in rates if sum(q["rate"] == r for q in points) < 2]
            if not todo or not fits("repeat", len(todo)):
                break
            round_(todo)

    def pd_min_tokens(self) -> int:
        """The conditional router's threshold: `--pd-min-tokens` when given, else the break-even this run's
        colocated and PD numbers imply (max-model-len when PD paid at no length: nothing goes PD), else the
        decider's default (colocated or PD did not run). Recorded with where it came from."""
        from goodput_threshold import measured_threshold

        cfg = self.result["config"]
        if "pd_min_tokens" in cfg:
            return int(cfg["pd_min_tokens"])
        value, source = self.args.pd_min_tokens, "flag"
        if value is None:
            value, source = measured_threshold(self.result, self.never), "measured"
        if value is None:
            value, source = DeciderConfig().min_pd_tokens, "default"
        cfg["pd_min_tokens"], cfg["pd_min_tokens_from"] = value, source
        _say(f"conditional: --pd-min-tokens {value} ({source})")
        return value

    def failed(self, name: str, exc: Exception) -> None:
        entry = self.result["setups"].setdefault(name, {"label": SETUPS[name], "workloads": {}})
        entry["failed"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
        self._save()

    def _slo(self, run: Any, w: str) -> tuple[Slo, float]:
        """The workload's SLOs and ladder unit, measured unloaded on the first setup that runs it."""
        from goodput_run import unloaded

        known = self.result["slo"].get(w)
        if known is None:
            ds = self.data.file(w, self.plan.mode.probe_prompts, -1)
            out = self.run_dir / run.name / w / "unloaded.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            time.sleep(SETTLE_S)  # the previous point's queue drains and its engines stop spinning first
            u = unloaded(run, self.args.model_dir, ds, out, self.plan.mode.probe_prompts)
            if 2 * u["coalesced"] > u["n"]:  # most streams arrived in one piece: probe again, keep the better
                _say(f"{w}: {u['coalesced']} of {u['n']} unloaded streams arrived in one piece; probing again")
                time.sleep(SETTLE_S)
                ds = self.data.file(w, self.plan.mode.probe_prompts, -3)
                again = unloaded(run, self.args.model_dir, ds, out.with_name("unloaded-again.json"), u["n"])
                u = min(u, again, key=lambda x: x["coalesced"] / max(x["n"], 1))
            slo = slo_from_unloaded(u["ttft_ms"], u["tpot_ms"])
            known = {"measured_on": run.name, "unloaded": u, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
            known["capacity_rps"] = capacity(2, u["ttft_ms"], u["tpot_ms"])
            self.result["slo"][w] = known
            _say(f"{w}: unloaded TTFT {u['ttft_ms']:.0f} ms, TPOT {u['tpot_ms']:.1f} ms -> SLO {slo.goodput_arg()}")
        return Slo(known["ttft_ms"], known["tpot_ms"]), known["capacity_rps"]

    def _warm(self, run: Any) -> None:
        """A fresh engine's first requests pay one-off costs (graph capture, allocator): a few, unscored."""
        from goodput_run import bench_serve, serve_argv

        ds = self.data.file("W2", 4, -2, run.name)
        out = self.run_dir / run.name / "warmup.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        bench_serve(serve_argv(run.url, self.args.model_dir, ds, 4, out, None, rate=4.0), out.with_suffix(".log"))

    def _save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.result, indent=1, default=str) + "\n")


def run(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    from goodput_setups import Context, Serving
    from pdgate.deploy.local.stack import ensure_model
    from pdgate.deploy.local.vllm_env import ensure_vllm_env
    from pdgate.deploy.local.vllm_instance import ServeFlags

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdgate-bench-goodput-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    flags = ServeFlags(model_dir=args.model_dir)
    result: dict[str, Any] = {
        "plan": plan.as_dict(),
        "config": {
            "model": flags.served_name,
            "engine_flags": flags.args()[1:],
            "run_dir": str(run_dir),
        },
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "loadavg_before": os.getloadavg(),
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "slo": {},
        "setups": {},
    }
    offline_loopback_env()
    try:
        import pandas  # noqa: F401  # vLLM's custom dataset reads JSONL with it
    except ImportError:
        sys.exit("bench/goodput.py needs pandas in the vLLM venv: .venv-vllm/bin/pip install -e '.[bench]'")
    t0 = time.monotonic()
    ensure_model(args.model_dir, ensure_vllm_env(args.venv, install=False, log=_say), _say)  # the datasets' tokenizer
    sweep = Sweep(plan, args, run_dir, result)
    sweep.never = flags.max_model_len
    ctx = Context(args.model_dir, run_dir, args.venv, flags, sweep.pd_min_tokens, _say)
    with Serving(plan.setups, ctx, sweep.failed) as serving:
        sweep.run(serving)
    result["wall_s"] = time.monotonic() - t0
    result["skipped_for_budget"] = sweep.skipped
    result["host"]["loadavg_after"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI mode: conditional only, W3, one rate, the decider check")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate; start nothing")
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=None)
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None)
    ap.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="skip growth and repeat points that would take the run past this (default 19; quick: none)",
    )
    ap.add_argument(
        "--pd-min-tokens",
        type=int,
        default=None,
        help="the conditional router's --pd-min-tokens (default: the break-even this run measures on colocated "
        "and PD before the conditional setup starts; the decider's default when one of them does not run)",
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--run-dir", type=Path, default=None, help="logs, datasets and vLLM's raw results")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/goodput[-quick].json")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/PERFORMANCE.md")
    ap.add_argument("--render-only", action="store_true", help="rewrite docs/PERFORMANCE.md from the results JSON")
    args = ap.parse_args(argv)
    mode = MODES["quick" if args.quick else "default"]
    setups = [s for s in SETUPS if s in (args.setups or mode.setups)]  # the order they start in
    plan = Plan(mode, tuple(setups), tuple(w for w in WORKLOADS if w in (args.workloads or mode.workloads)))
    if args.budget_min is None:
        args.budget_min = 0.0 if args.quick else 19.0
    args.out = args.out or RESULTS / ("goodput-quick.json" if args.quick else "goodput.json")
    if args.dry_run:
        print("\n".join(plan_lines(plan)))
        return 0
    from goodput_report import render_markdown, render_table

    multiturn = json.loads(MULTITURN.read_text()) if MULTITURN.exists() else None  # W4, its own bench
    overhead = json.loads(OVERHEAD.read_text()) if OVERHEAD.exists() else None
    if args.render_only:
        DOCS.write_text(render_markdown(json.loads(args.out.read_text()), multiturn, overhead))
        print(f"wrote {DOCS} from {args.out}")
        return 0
    result = run(plan, args)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(render_table(result))
    print(f"results: {args.out}")
    if not args.no_docs and not args.quick:
        DOCS.write_text(render_markdown(result, multiturn, overhead))
        print(f"wrote {DOCS}")
    check = result.get("quick_check")
    if args.quick and check is None:  # the conditional setup failed before the check could run
        why = result["setups"].get("conditional", {}).get("failed", "no check ran")
        check = {"pass": False, "problems": [f"conditional setup: {why}"]}
    if check is not None and not check["pass"]:
        print(f"FAILED: {check['problems']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

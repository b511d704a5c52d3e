"""Time to first token and end-to-end latency: pdgate PD (1P1D through the router) versus one vLLM, with
vLLM's own NixlConnector 1P1D behind pdgate-router as the anchor.

Phases, in one run and in sequence, so that no PD pair shares the machine with another pair's threads:
1. a connector-less single instance and pdgate's 1P1D stack (`pdgate.deploy.local.stack`: router with
   its embedded metaserver, prefill and decode with PDGateConnector over NIXL), started together; the
   same fresh prompts go to both in alternating order. Both are stopped after.
2. vLLM's stock NixlConnector 1P1D behind pdgate-router, as shipped (`tests/e2e/nixl_pair.py`);
3. the same pair hand-tuned as docs/NIXL.md describes (taskset + renice).
Phase 1 runs once per `--variants` entry (default: nixl): pdgate's engines over NIXL or Mooncake (tcp),
request-wise or layer-wise (`layerwise_min_tokens` 0: every synchronous load goes layer by layer), each
with its own single instance, so each variant's PD-single difference is read within its own phase.
Every pair gets pdgate-local's pinning policy (each engine's OMP threads on its own core, cores taken
in order); the tuned pair adds its tuning on top. What each process ended with (CPU sets of its threads,
nice) is read back from /proc and printed per configuration.

Per request, on the client: TTFT (request sent -> first token chunk) and E2E (-> last chunk), streaming
/v1/completions, temperature 0, ignore_eos. Per length: median and p90 of each.

Breakdown per configuration and length:
- r.*: the router's phase histograms (`pdgate_router_*_seconds` on its /metrics; means): prefill request
  to answer, ledger create, decode request to its first byte, the router's own time.
- pdgate decode (its connector's per-transfer log line "transfer <id>: ... loaded N tokens in T ms
  (claim C, pull P [transport X], confirm F)", matched by the X-Request-Id the router answers with):
  claim (0 under the router's claim), pull (the read alone in brackets), confirm, and "rest" = the
  router's decode first byte minus the whole KV load. An idle decode under the router's claim (the
  default, `sync_load_when_idle`) loads synchronously: its pull is what the step that computes the first
  token waited for the read in `start_load_kv`, and "rest" is everything else of the decode (request
  intake, scheduling, the forward, the way out). An asynchronous load's pull runs from allocation to the
  outcome in the scheduler half (worker hand-off + NIXL read), and its "rest" adds the step after it.
- NixlConnector decode: the NIXL read, from vLLM's `vllm:nixl_xfer_time_seconds` histogram (mean per
  length); there is no claim and no ledger on that path.

Target (issue 13): pdgate PD median TTFT <= single + transfer + 5 ms. Printed per length; no assertion.

    .venv-vllm/bin/python bench/e2e.py [--lengths 128 512 2048] [--reps 12] [--no-nixl] [--out bench/results/e2e.json]
    .venv-vllm/bin/python bench/e2e.py --no-nixl --connector-extra '{"sync_load_when_idle": false}'  # the async path
    .venv-vllm/bin/python bench/e2e.py --variants nixl mooncake nixl-layerwise mooncake-layerwise
    .venv-vllm/bin/python bench/e2e.py --load 256     # vllm bench serve at 256 concurrent (bench/e2e_load.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import orjson  # noqa: E402
from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR, LocalStack, SingleInstance, StackConfig  # noqa: E402
from pdgate.deploy.local.tiny_model import MODEL_NAME  # noqa: E402
from pdgate.deploy.local.vllm_instance import ServeFlags  # noqa: E402

from tests.e2e.nixl_pair import AS_SHIPPED, TUNED, NixlPair, Tuning, describe_pinning, process_pinning  # noqa: E402

BLOCK = 32
PHASES = ("prefill", "handoff", "decode_ttft", "overhead", "e2e")
# pdgate's phase 1 variants: name -> (transport, kv_connector_extra_config keys on top of --connector-extra)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl": ("nixl", {}),
    "mooncake": ("mooncake", {}),
    "nixl-layerwise": ("nixl", {"layerwise_min_tokens": 0}),
    "mooncake-layerwise": ("mooncake", {"layerwise_min_tokens": 0}),
}
NIXL_XFER = "vllm:nixl_xfer_time_seconds"


def _say(msg: str) -> None:
    print(f"[bench/e2e] {msg}", flush=True)


def prompt_ids(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(f"bench-{length}-{seed}")
    return [rng.randrange(3, 2048) for _ in range(length)]


def stream_once(client: httpx.Client, base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion; client-side TTFT and E2E in seconds, and the X-Request-Id."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,  # a chunk may carry several tokens when the reader lags
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    headers = {"Content-Type": "application/json"}
    with client.stream("POST", base_url + "/v1/completions", content=orjson.dumps(body), headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{base_url} answered {resp.status_code}: {resp.read()[:500]!r}")
        request_id = resp.headers.get("x-request-id", "")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"{base_url} streamed an error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                tokens += len(choice.get("token_ids") or ())
                if ttft is None:
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    if ttft is None or tokens != max_tokens:
        raise RuntimeError(f"{base_url} streamed {tokens} tokens, expected {max_tokens}")
    return {"ttft": ttft, "e2e": e2e, "id": request_id}


def histograms(base_url: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each named histogram on a /metrics page (summed over label sets)."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    out = {n: (0.0, 0.0) for n in names}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "_sum") or line.startswith(n + "_count"):
                total, count = out[n]
                value = float(line.split()[-1])
                out[n] = (total + value, count) if "_sum" in line.split()[0] else (total, count + value)
    return out


def first_tokens_taken(base_url: str) -> float:
    """Streams whose first token came from the prefill (router/first_token.py), so far."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    want = 'pdgate_router_first_token_from_prefill_total{taken="true"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def router_histograms(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each router phase histogram."""
    raw = histograms(base_url, tuple(f"pdgate_router_{p}_seconds" for p in PHASES))
    return {p: raw[f"pdgate_router_{p}_seconds"] for p in PHASES}


def phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    means = {}
    for phase in after:
        ds = after[phase][0] - before[phase][0]
        dc = after[phase][1] - before[phase][1]
        means[phase] = ds / dc if dc else float("nan")
    return means


_LOADED = re.compile(
    r"transfer (?P<tid>\S+): \S+ loaded (?P<tokens>\d+) tokens in (?P<total>[\d.]+) ms "
    r"\(claim (?P<claim>[\d.]+), pull (?P<pull>[\d.]+) \[transport (?P<transport>[\d.]+)\], "
    r"confirm (?P<confirm>[\d.]+)\)"
)


def transfer_lines(log_path: Path) -> dict[str, dict[str, float]]:
    """transfer id -> the decode connector's timing of that KV load, in ms (from its log)."""
    out = {}
    for m in _LOADED.finditer(log_path.read_text(errors="replace")):
        out[m["tid"]] = {k: float(m[k]) for k in ("tokens", "total", "claim", "pull", "transport", "confirm")}
    return out


def p50(values: list[float]) -> float:
    return statistics.median(values)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]


def latency(samples: list[dict[str, Any]]) -> dict[str, float]:
    ttft, e2e = [s["ttft"] for s in samples], [s["e2e"] for s in samples]
    return {"ttft_p50_s": p50(ttft), "ttft_p90_s": p90(ttft), "e2e_p50_s": p50(e2e), "e2e_p90_s": p90(e2e)}


def warm(client: httpx.Client, urls: list[str], n: int, max_tokens: int) -> None:
    """First requests of a fresh engine pay one-off costs."""
    for i in range(n):
        for url in urls:
            stream_once(client, url, prompt_ids(64, seed=-1 - i), max_tokens)


def run_pdgate_phase(
    args: argparse.Namespace, run_dir: Path, flags: ServeFlags, lengths: list[int], variant: str = "nixl"
) -> dict[str, Any]:
    """Phase 1: the single instance and pdgate 1P1D, same prompts, alternating order."""
    transport, extra = VARIANTS[variant]
    single = SingleInstance(
        model_dir=args.model_dir, run_dir=run_dir / f"single-{variant}", venv=args.venv, cpu="1", flags=flags, log=_say
    )
    stack = LocalStack(
        StackConfig(
            model_dir=args.model_dir,
            run_dir=run_dir / f"pd-{variant}",
            venv=args.venv,
            port=args.port,
            transport=transport,
            connector_extra={**json.loads(args.connector_extra), **extra},
        ),
        log=_say,
    )
    rows = []
    try:
        single.launch()
        stack.start()
        single.wait()
        assert single.proc is not None and single.proc.pid is not None
        pinning = {"single": process_pinning(single.proc.pid)}
        pinning.update({h.instance_id: process_pinning(h.proc.pid) for h in stack.instances if h.proc.pid})
        with httpx.Client(timeout=300, trust_env=False) as client:
            warm(client, [single.url, stack.url], args.warmup, args.max_tokens)
            for length in lengths:
                before = router_histograms(stack.url)
                taken_before = first_tokens_taken(stack.url)
                single_s: list[dict[str, Any]] = []
                pd_s: list[dict[str, Any]] = []
                for rep in range(args.reps):
                    prompt = prompt_ids(length, seed=rep)
                    order = [(single_s, single.url), (pd_s, stack.url)]
                    if rep % 2:
                        order.reverse()
                    for out, url in order:
                        time.sleep(args.gap_s)  # let every process go idle: each request starts cold alike
                        out.append(stream_once(client, url, prompt, args.max_tokens))
                phases = phase_means(before, router_histograms(stack.url))
                logged = transfer_lines(stack.by_role("decode")[0].log_path)
                loads = [logged[s["id"]] for s in pd_s if s["id"] in logged]
                if len(loads) != len(pd_s):
                    raise RuntimeError(
                        f"the decode log has the KV-load line of {len(loads)} of {len(pd_s)} requests "
                        "(did the connector's log format change?)"
                    )
                kv = {k: p50([x[k] for x in loads]) / 1e3 for k in ("claim", "pull", "transport", "confirm", "total")}
                single_lat, pd_lat = latency(single_s), latency(pd_s)
                row: dict[str, Any] = {
                    "prompt_tokens": length,
                    "single": single_lat,
                    "pdgate": pd_lat,
                    "transfer_s": kv["pull"],
                    "transport_s": kv["transport"],
                    "claim_s": kv["claim"],
                    "confirm_s": kv["confirm"],
                    "kv_load_total_s": kv["total"],
                    "decode_rest_s": phases["decode_ttft"] - kv["total"],
                    "first_token_from_prefill": int(first_tokens_taken(stack.url) - taken_before),
                    "router_phase_mean_s": phases,
                    "samples": {"single": single_s, "pdgate": pd_s, "kv_loads": loads},
                }
                row["target_ttft_s"] = single_lat["ttft_p50_s"] + kv["pull"] + 0.005
                row["target_met"] = pd_lat["ttft_p50_s"] <= row["target_ttft_s"]
                rows.append(row)
                _say(f"single + pdgate ({variant}): {length} tokens done")
    finally:
        stack.stop()
        single.stop()
    return {"variant": variant, "rows": rows, "pinning": pinning, "startup": stack.timings}


def run_nixl_phase(
    args: argparse.Namespace, run_dir: Path, flags: ServeFlags, lengths: list[int], tuning: Tuning
) -> dict[str, Any]:
    """Phases 2 and 3: vLLM's NixlConnector 1P1D behind pdgate-router, the same prompts in the same order."""
    tag = "nixl-tuned" if tuning.taskset else "nixl-shipped"
    pair = NixlPair(
        model_dir=args.model_dir, run_dir=run_dir / tag, venv=args.venv, flags=flags, tuning=tuning, log=_say
    )
    rows = []
    with pair:
        pinning = pair.pinning()
        decode = pair.engine("decode").url
        with httpx.Client(timeout=300, trust_env=False) as client:
            warm(client, [pair.url], args.warmup, args.max_tokens)
            for length in lengths:
                before = router_histograms(pair.url)
                x0 = histograms(decode, (NIXL_XFER,))
                samples: list[dict[str, Any]] = []
                for rep in range(args.reps):
                    time.sleep(args.gap_s)
                    samples.append(stream_once(client, pair.url, prompt_ids(length, seed=rep), args.max_tokens))
                xfer = phase_means(x0, histograms(decode, (NIXL_XFER,)))[NIXL_XFER]
                phases = phase_means(before, router_histograms(pair.url))
                rows.append(
                    {
                        "prompt_tokens": length,
                        "latency": latency(samples),
                        "nixl_xfer_mean_s": xfer,
                        "router_phase_mean_s": phases,
                        "samples": samples,
                    }
                )
                _say(f"{tag}: {length} tokens done")
    return {"tuning": tuning.name, "rows": rows, "pinning": pinning}


def nixl_phase_or_failure(
    args: argparse.Namespace, run_dir: Path, flags: ServeFlags, lengths: list[int], tuning: Tuning
) -> dict[str, Any]:
    """A NixlConnector phase, or what ended it: the stock pair on 2 cores sometimes stalls past its own
    30 s KV lease and loses an engine, and the pdgate phase's numbers must not be lost with it."""
    try:
        return run_nixl_phase(args, run_dir, flags, lengths, tuning)
    except (RuntimeError, httpx.HTTPError) as exc:
        _say(f"NixlConnector phase ({tuning.name}) failed: {exc}")
        return {"tuning": tuning.name, "rows": [], "pinning": {}, "failed": str(exc)[:500]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdgate-bench-e2e-"))
    flags = ServeFlags(model_dir=args.model_dir)
    limit = flags.max_model_len - args.max_tokens
    lengths = [n for n in args.lengths if n <= limit]
    skipped = [n for n in args.lengths if n > limit]
    if skipped:
        _say(f"skipping prompt lengths {skipped}: above the model's limit ({flags.max_model_len} - max_tokens)")
    t_start = time.monotonic()
    variants = {v: run_pdgate_phase(args, run_dir, flags, lengths, v) for v in args.variants}
    pdgate = variants[args.variants[0]]
    tunings = () if args.no_nixl else (AS_SHIPPED, TUNED)
    nixl = [nixl_phase_or_failure(args, run_dir, flags, lengths, t) for t in tunings]
    return {
        "config": {
            "lengths": lengths,
            "skipped_lengths": skipped,
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "gap_s": args.gap_s,
            "block_size": BLOCK,
            "model": MODEL_NAME,
            "max_model_len": flags.max_model_len,
            "topology": "1P1D; NIXL over UCX on lo; pdgate: router with embedded metaserver; "
            "nixl: vLLM NixlConnector (kv_producer/kv_consumer) behind pdgate-router with static URLs",
            "connector_extra": json.loads(args.connector_extra),
        },
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "wall_s": time.monotonic() - t_start,
        "pdgate": pdgate,
        "variants": variants,
        "nixl": nixl,
    }


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f}" if v == v else "-"


def print_tables(result: dict[str, Any], out: Callable[[str], None] = print) -> None:
    cfg = result["config"]
    pd = result["pdgate"]
    variants: dict[str, Any] = result.get("variants") or {"nixl": pd}  # results from before --variants
    configs: list[tuple[str, list[dict[str, float]]]] = []
    for name, v in variants.items():
        configs.append((f"single vLLM, no connector (beside {name})", [r["single"] for r in v["rows"]]))
        configs.append((f"**pdgate 1P1D, {name}** (pdgate-local's pinning)", [r["pdgate"] for r in v["rows"]]))
    for n in result["nixl"]:
        name = f"vLLM NixlConnector 1P1D, {n['tuning']}, behind pdgate-router"
        if n.get("failed"):
            out(f"{name}: failed ({n['failed'][:200]})")
            continue
        configs.append((name, [r["latency"] for r in n["rows"]]))
    lengths = cfg["lengths"]
    out(
        f"\nTTFT median / p90 and E2E median / p90 in ms, {cfg['reps']} streaming requests per cell, "
        f"{cfg['max_tokens']} tokens out; load {result['host']['loadavg'][0]:.1f} on {result['host']['cpus']} CPUs"
    )
    out("| setup | " + " | ".join(f"{n} TTFT | {n} E2E" for n in lengths) + " |")
    out("|---|" + "---:|" * (2 * len(lengths)))
    for name, lats in configs:
        cells = []
        for lat in lats:
            cells.append(f"{_ms(lat['ttft_p50_s'])} / {_ms(lat['ttft_p90_s'])}")
            cells.append(f"{_ms(lat['e2e_p50_s'])} / {_ms(lat['e2e_p90_s'])}")
        out(f"| {name} | " + " | ".join(cells) + " |")
    out("\npdgate target: median TTFT <= single + transfer + 5 ms")
    out(
        "| variant | prompt | single | pdgate | PD/single | PD-single | transfer (read) | target | met "
        "| 1st token from prefill |"
    )
    out("|---|---:|---:|---:|---:|---:|---:|---:|:-:|---:|")
    for name, v in variants.items():
        for r in v["rows"]:
            s, p = r["single"]["ttft_p50_s"], r["pdgate"]["ttft_p50_s"]
            out(
                f"| {name} | {r['prompt_tokens']} | {s * 1e3:.1f} | {p * 1e3:.1f} | {p / s:.2f}x "
                f"| {(p - s) * 1e3:+.1f} "
                f"| {r['transfer_s'] * 1e3:.1f} ({r['transport_s'] * 1e3:.1f}) | {r['target_ttft_s'] * 1e3:.1f} "
                f"| {'yes' if r['target_met'] else 'no'} | {r.get('first_token_from_prefill', '-')} of {cfg['reps']} |"
            )
    out("\nBreakdown (ms): router phase means; decode KV-load medians from its per-transfer log or NIXL's histogram")
    out(
        "| setup | prompt | r.prefill | r.handoff | r.decode 1st byte | d.claim | d.pull (read) | d.confirm "
        "| d.rest | r.overhead |"
    )
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in variants.items():
        for r in v["rows"]:
            _breakdown_row(out, f"pdgate {name}", r)
    for n in result["nixl"]:
        for r in n["rows"]:
            ph = r["router_phase_mean_s"]
            out(
                f"| nixl, {n['tuning']} | {r['prompt_tokens']} | {ph['prefill'] * 1e3:.1f} | {ph['handoff'] * 1e3:.2f} "
                f"| {ph['decode_ttft'] * 1e3:.1f} | - | ({r['nixl_xfer_mean_s'] * 1e3:.1f}) | - "
                f"| {(ph['decode_ttft'] - r['nixl_xfer_mean_s']) * 1e3:.1f} | {ph['overhead'] * 1e3:.2f} |"
            )
    out("\nPinning each configuration ended with (read back from /proc: CPU set -> threads, nice):")
    for vname, v in variants.items():
        for name, rows in v["pinning"].items():
            out(f"- pdgate {vname} phase, {name}: {describe_pinning(rows)}")
    for n in result["nixl"]:
        for role, rows in n["pinning"].items():
            out(f"- nixl {n['tuning']}, {role}: {describe_pinning(rows)}")


def _breakdown_row(out: Callable[[str], None], name: str, r: dict[str, Any]) -> None:
    ph = r["router_phase_mean_s"]
    out(
        f"| {name} | {r['prompt_tokens']} | {ph['prefill'] * 1e3:.1f} | {ph['handoff'] * 1e3:.2f} "
        f"| {ph['decode_ttft'] * 1e3:.1f} | {r['claim_s'] * 1e3:.1f} "
        f"| {r['transfer_s'] * 1e3:.1f} ({r['transport_s'] * 1e3:.1f}) | {r['confirm_s'] * 1e3:.1f} "
        f"| {r['decode_rest_s'] * 1e3:.1f} | {ph['overhead'] * 1e3:.2f} |"
    )


LEGEND = (
    "transfer: the pdgate decode worker's pull, median (in brackets: the NIXL read alone; for the NixlConnector "
    "rows vLLM's nixl_xfer_time mean). r.*: the router's phase means (prefill request, ledger create - the router "
    "creates a record for stock engines too, unused -, decode request to its first byte, the router's own time). "
    "d.claim / d.confirm: the pdgate decode's ledger steps around the pull (claim 0: the router claimed). "
    "d.rest: decode first byte minus the KV load (request intake, the engine's steps and forward, output; the pull "
    "of a synchronous load - an idle decode under the router's claim - is what its step waited). READY's own time "
    "after the prefill answers is not in these logs (the prefill connector logs it at DEBUG only)."
)


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--load", type=int, default=0)
    early, rest = pre.parse_known_args()
    if early.load:  # every other flag is bench/e2e_load.py's (its --out, --run-dir, --setups...)
        sys.path.insert(0, str(Path(__file__).parent))
        import e2e_load

        e2e_load.main(["--concurrency", str(early.load), *rest])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gap-s", type=float, default=0.5, help="pause before each request (default 0.5)")
    ap.add_argument("--no-nixl", action="store_true", help="skip the NixlConnector phases")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["nixl"], help="pdgate phases")
    ap.add_argument(
        "--load", type=int, default=0, help="run bench/e2e_load.py at this concurrency instead (its flags follow)"
    )
    ap.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    ap.add_argument(
        "--connector-extra",
        default="{}",
        help="JSON of kv_connector_extra_config keys for the pdgate engines, e.g. '{\"sync_load_when_idle\": false}'",
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e.json")
    ap.add_argument("--render", type=Path, default=None, help="print the tables of a saved result and exit")
    args = ap.parse_args()
    if args.render:
        print_tables(json.loads(args.render.read_text()))
        print(LEGEND)
        return
    if args.port == 0:
        from pdgate.deploy.local.procs import free_port

        args.port = free_port()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result)
    print(LEGEND)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Time to first token and end-to-end latency: pdgate PD (1P1D through the router) versus one vLLM.

Starts, with `pdgate.deploy.local.stack`, a connector-less single instance and a 1P1D stack (router with its
embedded metaserver, prefill and decode with PDGateConnector over NIXL), then for each prompt length
sends the same fresh prompts (streaming /v1/completions, temperature 0, ignore_eos) to both, in
alternating order, and measures on the client: TTFT (request sent -> first token chunk) and E2E
(-> last chunk). The router's own phase histograms (`pdgate_router_*_seconds` on its /metrics) give
the breakdown of the PD side per length: prefill, handoff (ledger create), decode first byte (claim +
pull + first token on decode), router overhead.

Transfer time, per request: the decode's connector logs one line per KV load ("transfer <id>: ...
loaded N tokens in T ms (claim C, pull P [transport X], confirm F)"); the router answers with the
transfer id as X-Request-Id, so each PD request is matched to its own line. "transfer" below is the
pull (worker hand-off + NIXL read); claim and confirm are the ledger round trips around it.

Target (from the issue): PD TTFT <= single TTFT + transfer + 5 ms. Printed per length; no assertion.

    .venv-vllm/bin/python bench/e2e.py [--lengths 128 512 2048] [--reps 8] [--out bench/results/e2e.json]
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

BLOCK = 32
PHASES = ("prefill", "handoff", "decode_ttft", "overhead", "e2e")


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


def router_histograms(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each router phase histogram."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, tuple[float, float]] = {}
    for phase in PHASES:
        name = f"pdgate_router_{phase}_seconds"
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total = float(line.split()[-1])
            elif line.startswith(name + "_count"):
                count = float(line.split()[-1])
        out[phase] = (total, count)
    return out


def phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    means = {}
    for phase in PHASES:
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdgate-bench-e2e-"))
    flags = ServeFlags(model_dir=args.model_dir)
    limit = flags.max_model_len - args.max_tokens
    lengths = [n for n in args.lengths if n <= limit]
    skipped = [n for n in args.lengths if n > limit]
    if skipped:
        _say(f"skipping prompt lengths {skipped}: above the model's limit ({flags.max_model_len} - max_tokens)")
    single = SingleInstance(
        model_dir=args.model_dir, run_dir=run_dir / "single", venv=args.venv, cpu="1", flags=flags, log=_say
    )
    stack = LocalStack(
        StackConfig(model_dir=args.model_dir, run_dir=run_dir / "pd", venv=args.venv, port=args.port), log=_say
    )
    t_start = time.monotonic()
    try:
        single.launch()
        stack.start()
        single.wait()
        startup_s = time.monotonic() - t_start
        rows = []
        with httpx.Client(timeout=300, trust_env=False) as client:
            for i in range(args.warmup):  # first requests of a fresh engine pay one-off costs
                warm = prompt_ids(64, seed=-1 - i)
                stream_once(client, single.url, warm, args.max_tokens)
                stream_once(client, stack.url, warm, args.max_tokens)
            for length in lengths:
                before = router_histograms(stack.url)
                single_s: list[dict[str, float]] = []
                pd_s: list[dict[str, float]] = []
                per_request: list[dict[str, float]] = []
                for rep in range(args.reps):
                    prompt = prompt_ids(length, seed=rep)
                    order = [("single", single.url), ("pd", stack.url)]
                    if rep % 2:
                        order.reverse()
                    for name, url in order:
                        time.sleep(args.gap_s)  # let every process go idle: each request starts cold alike
                        if name == "single":
                            single_s.append(stream_once(client, url, prompt, args.max_tokens))
                            continue
                        mark = router_histograms(stack.url)
                        pd_s.append(stream_once(client, url, prompt, args.max_tokens))
                        per_request.append(phase_means(mark, router_histograms(stack.url)))
                phases = phase_means(before, router_histograms(stack.url))
                logged = transfer_lines(stack.by_role("decode")[0].log_path)
                loads = [logged[s["id"]] for s in pd_s if s["id"] in logged]
                if len(loads) != len(pd_s):
                    raise RuntimeError(
                        f"the decode log has the KV-load line of {len(loads)} of {len(pd_s)} requests "
                        "(did the connector's log format change?)"
                    )
                row = {
                    "prompt_tokens": length,
                    "single_ttft_s": p50([s["ttft"] for s in single_s]),
                    "pd_ttft_s": p50([s["ttft"] for s in pd_s]),
                    "single_e2e_s": p50([s["e2e"] for s in single_s]),
                    "pd_e2e_s": p50([s["e2e"] for s in pd_s]),
                    "transfer_s": p50([x["pull"] for x in loads]) / 1e3,
                    "transport_s": p50([x["transport"] for x in loads]) / 1e3,
                    "claim_s": p50([x["claim"] for x in loads]) / 1e3,
                    "confirm_s": p50([x["confirm"] for x in loads]) / 1e3,
                    "kv_load_total_s": p50([x["total"] for x in loads]) / 1e3,
                    "router_phase_mean_s": phases,
                    "samples": {"single": single_s, "pd": pd_s, "pd_router_phases": per_request, "kv_loads": loads},
                }
                row["target_ttft_s"] = row["single_ttft_s"] + row["transfer_s"] + 0.005
                row["target_met"] = row["pd_ttft_s"] <= row["target_ttft_s"]
                rows.append(row)
                _say(f"{length} tokens done")
    finally:
        stack.stop()
        single.stop()
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
            "topology": "1P1D, router with embedded metaserver, NIXL over UCX on lo",
        },
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "startup_s": startup_s,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nTTFT / E2E in ms, medians of {cfg['reps']} streaming requests per length, {cfg['max_tokens']} tokens out; "
        f"router phases are means; load {result['host']['loadavg'][0]:.1f} on {result['host']['cpus']} CPUs"
    )
    print(
        "| prompt | single TTFT | PD TTFT | PD-single | transfer (NIXL) | target | met | single E2E | PD E2E "
        "| r.prefill | r.handoff | r.decode 1st byte | d.claim | d.confirm | r.overhead |"
    )
    print("|---:|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        ph = r["router_phase_mean_s"]
        print(
            f"| {r['prompt_tokens']} | {r['single_ttft_s'] * 1e3:.1f} | {r['pd_ttft_s'] * 1e3:.1f} "
            f"| {(r['pd_ttft_s'] - r['single_ttft_s']) * 1e3:+.1f} "
            f"| {r['transfer_s'] * 1e3:.1f} ({r['transport_s'] * 1e3:.1f}) "
            f"| {r['target_ttft_s'] * 1e3:.1f} | {'yes' if r['target_met'] else 'no'} "
            f"| {r['single_e2e_s'] * 1e3:.1f} | {r['pd_e2e_s'] * 1e3:.1f} | {ph['prefill'] * 1e3:.1f} "
            f"| {ph['handoff'] * 1e3:.2f} | {ph['decode_ttft'] * 1e3:.1f} | {r['claim_s'] * 1e3:.1f} "
            f"| {r['confirm_s'] * 1e3:.1f} | {ph['overhead'] * 1e3:.2f} |"
        )


LEGEND = (
    "transfer (NIXL): the decode worker's pull, median ms (in brackets: the NIXL read alone); target = single TTFT "
    "+ transfer + 5 ms. r.*: the router's phase means (prefill request, ledger create, decode request to its "
    "first byte, the router's own time). d.claim / d.confirm: the decode connector's ledger round trips "
    "before and after the pull (medians)."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gap-s", type=float, default=0.5, help="pause before each request (default 0.5)")
    ap.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e.json")
    args = ap.parse_args()
    if args.port == 0:
        from pdgate.deploy.local.procs import free_port

        args.port = free_port()
    result = run(args)
    print_table(result)
    print(LEGEND)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

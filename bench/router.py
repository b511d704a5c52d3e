"""Benchmark of the router: throughput, latency and router CPU per request in front of 2P2D simulators.

Processes (all real, over loopback): a metaserver (`python -m pdgate.metaserver`, memory store), 2 prefill and
2 decode `pdgate-sim`s registered with it, and proxies in front of the same sims:
  router     `pdgate-router --metaserver URL` (the production shape: ledger in its own service)
  isolated   the same router in front of canned engines and a canned metaserver (one raw ASGI process
             that answers at once): the router's own cost, with nothing else competing for the box
  embedded   `pdgate-router --prefill .. --decode ..` with the metaserver in-process: its CPU also
             covers serving the engines' ledger calls (READY, claim, DONE: 3 HTTP calls per request)
  toy        a proxy written like vLLM's toy_proxy_server.py (FastAPI + httpx, P then D), for scale
  vllm-router    the Rust vllm-router from PyPI (`--vllm-pd-disaggregation`, round robin): P then D with
                 vLLM's kv_transfer_params; the sims skip the ledger for it (no transfer_id)
  sglang-router  the Rust SGLang router from PyPI (`--pd-disaggregation`, round robin): SGLang's protocol,
                 P and D at once with bootstrap fields; the sims answer both as plain completions
                 (bench/peers_env.py installs both into the git-ignored .venv-peers)
and `direct`: no proxy, the client itself creates the handoff, calls P, then D (same engine work).
A pdgate mode with an `@base` suffix (`embedded@base`) is the same mode run from the package tree given
by `--baseline DIR` (PYTHONPATH=DIR: e.g. the commit before a change, `git archive` into DIR/pdgate/):
before and after measured in one run, alternating, on the same sims.
A pdgate mode with a `+decider` suffix (`isolated+decider`) runs with the conditional decider and the
KV-event index on (`DECIDER_ARGS`), one with `+policies` with the default policies and neither; `--token-prompts
N` sends prompts of N token ids, which cache_aware hashes into block keys (text prompts are not hashed).
Issue #22's A/B (docs/PERFORMANCE.md) is runs of `--quick --pin --token-prompts 512 --only 1 32 64 --modes`
and, for each of isolated and router, MODE MODE+policies MODE+affinity MODE+cacheonly MODE+decider (the
modes reversed in every other run), written to bench/results/router-decider-ab-N.json.
A mode with a `_wN` suffix (`router_w2`, `isolated_w2`) is the same router started with `--workers N`
(one port, N processes, `pdgate.router.workers`); its CPU is the sum over the parent and its workers, and
its req/s against the plain mode is the scaling of `--workers` (issue 12 asks for >= 1.8x with 2 on 2 cores).
With `--pin`, proxies are pinned to CPU 0 with taskset and everything else to the other CPUs (off by
default: on a shared 2-vCPU VM that added milliseconds of latency at concurrency 1).
The load generator is a keep-alive HTTP/1.1 client on uvloop (pdgate.http_pool.HttpPool).

Router CPU per request = (on-CPU time of the proxy process's threads and its children's, from
/proc/<pid>/task/*/schedstat in ns, after - before) / requests. Scenarios: non-streaming (16 tokens) at
concurrency 1, 32, 256, 1024 and 4096, and streaming (32 tokens) at 64. A table then sets each pdgate mode
against the best Rust peer of the same run (`versus_peers`: ratios of CPU per request and of p99).
`--libs` first measures the candidate HTTP clients, ASGI stacks and JSON libraries alone.
Prints tables and writes bench/results/router.json.

    .venv-vllm/bin/python bench/router.py [--quick] [--libs] [--pin] [--only 1 32] [--modes router direct ...]
        [--baseline DIR --modes embedded embedded@base] [--profile bench/results/router-profile-after.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench.peers_env import PEER_MODES, peer_command
from bench.router_libs import measure_libs
from bench.router_procs import LOGS, PY, ROOT, Procs, cpus, start_profile, summarize_profile, tree_cpu_seconds
from bench.router_scripts import CANNED, TOY_PROXY
from tests.support.ports import free_port
from tests.support.servers import wait_http

TARGETS = {"cpu_us_nonstream_c32": 400, "cpu_us_stream32": 600, "errors_c1024": 0, "added_p50_ms_c1": 1.0}


# -- load generation --------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_load(
    url: str, concurrency: int, total: int, stream: bool, tokens: int, direct: dict[str, Any] | None
) -> dict[str, Any]:
    from pdgate.http_pool import HttpPool
    from pdgate.meta_pooled import PooledMetaClient
    from pdgate.models import HandoffCreate

    pool = HttpPool(connect_timeout=10)
    meta = PooledMetaClient(direct["metaserver"], pool=pool, admin_token=ADMIN_TOKEN, timeout=60) if direct else None
    headers = [(b"content-type", b"application/json")]
    lat: list[float] = []
    ttft: list[float] = []
    errors: list[str] = []
    counter = 0

    async def one(i: int) -> None:
        prompt: Any = f"benchmark prompt number {i} " * 8
        if TOKEN_PROMPTS:  # token ids: what cache_aware hashes into the engines' block keys
            prompt = [3 + (i * 7 + k) % 2000 for k in range(TOKEN_PROMPTS)]
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": tokens}
        if stream:
            body["stream"] = True
        t0 = time.perf_counter()
        first = None
        try:
            if direct is None:
                resp = await pool.request("POST", url + "/v1/completions", headers, orjson.dumps(body), timeout=120)
            else:
                assert meta is not None
                p_url = direct["prefill"][i % len(direct["prefill"])]
                d_url = direct["decode"][i % len(direct["decode"])]
                h = await meta.create_handoff(HandoffCreate(prefill_instance_id=direct["prefill_ids"][p_url]))
                params = {"do_remote_decode": True, "transfer_id": h.transfer_id, "kv_key": h.kv_key}
                params["metaserver"] = direct["metaserver"]
                p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
                pr = await pool.request("POST", p_url + "/v1/completions", headers, orjson.dumps(p_body), timeout=120)
                kv = orjson.loads(await pr.read(timeout=120))["kv_transfer_params"]
                kv.update(do_remote_prefill=True, do_remote_decode=False, metaserver=direct["metaserver"])
                d_body = dict(body, kv_transfer_params=kv)
                resp = await pool.request("POST", d_url + "/v1/completions", headers, orjson.dumps(d_body), timeout=120)
            parts = []
            while (chunk := await resp.next_chunk(120)) is not None:
                if first is None:
                    first = time.perf_counter()
                parts.append(chunk)
            data = b"".join(parts)
            if resp.status != 200:
                errors.append(f"{resp.status}: {data[:200]!r}")
            elif stream and (b'"error"' in data or not data.rstrip().endswith(b"[DONE]")):
                errors.append(f"stream: {data[-200:]!r}")
        except Exception as exc:
            errors.append(repr(exc))
            return
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        ttft.append((first or t1) - t0)

    async def worker() -> None:
        nonlocal counter
        while counter < total:
            i = counter
            counter += 1
            await one(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await pool.aclose()
    return {"elapsed": elapsed, "lat": lat, "ttft": ttft, "errors": errors}


def load(url: str, concurrency: int, total: int, stream: bool, tokens: int, direct: Any = None) -> dict[str, Any]:
    import uvloop

    return uvloop.run(run_load(url, concurrency, total, stream, tokens, direct))


# -- the stack --------------------------------------------------------------------------------


# Every pdgate process runs with an admin token, as a deployment does: the router seals its claims with
# it and the sims check the seal (without one a decode trusts no claim and claims again itself).
ADMIN_TOKEN = "bench-router-admin-token"
TOKEN_ENV = {
    "PDGATE_METASERVER_ADMIN_TOKEN": ADMIN_TOKEN,  # the metaserver, and the router's embedded one
    "PDGATE_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
    "PDGATE_ROUTER_METASERVER_TOKEN": ADMIN_TOKEN,  # the router -> a separate metaserver
    "PDGATE_SIM_ADMIN_TOKEN": ADMIN_TOKEN,
}


def start_stack(procs: Procs, modes: list[str], baseline: str | None = None) -> dict[str, Any]:
    os.environ.update(TOKEN_ENV)  # inherited by every process started below
    meta_port = free_port()
    meta_url = f"http://127.0.0.1:{meta_port}"
    other = f"1-{cpus() - 1}" if cpus() > 1 else "0"
    procs.start(
        "metaserver",
        [PY, "-m", "pdgate.metaserver", "--port", str(meta_port), "--log-level", "warning"],
        other,
    )
    wait_http(meta_url + "/health", timeout=30)
    sims: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role in ("prefill", "prefill", "decode", "decode"):
        port = free_port()
        cmd = [PY, "-m", "pdgate.sim", "--role", role, "--port", str(port), "--metaserver", meta_url]
        # An overloaded box shows as latency, not as errors or lapsed registrations.
        cmd += ["--metaserver-timeout-s", "60", "--lease-s", "60"]
        procs.start(f"sim-{role}-{port}", cmd, other)
        sims[role].append(f"http://127.0.0.1:{port}")
    for url in sims["prefill"] + sims["decode"]:
        wait_http(url + "/v1/models", timeout=30)
    out: dict[str, Any] = {"metaserver": meta_url, "sims": sims, "proxies": {}}
    static = [a for u in sims["prefill"] for a in ("--prefill", u)] + [
        a for u in sims["decode"] for a in ("--decode", u)
    ]
    for mode_name in modes:
        if mode_name == "direct":
            continue
        plain, _, variant = mode_name.partition("@")
        env = {"PYTHONPATH": baseline} if variant == "base" and baseline else None
        if variant and env is None:
            raise SystemExit(f"mode {mode_name} needs --baseline DIR")
        plain, plus, extra = plain.partition("+")
        mode, _, n_workers = plain.partition("_w")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        base = [PY, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        base += ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
        base += ["--metaserver-timeout-s", "60"]
        if mode == "router":
            cmd = [*base, "--metaserver", meta_url]
        elif mode == "isolated":
            canned_port = free_port()
            procs.start("canned", [PY, "-c", CANNED, str(canned_port)], other)
            wait_http(f"http://127.0.0.1:{canned_port}/health", timeout=30)
            cmd = [*base, "--metaserver", f"http://127.0.0.1:{canned_port}"]
        elif mode == "embedded":
            cmd = [*base, *static]
        elif mode == "toy":
            cmd = [PY, "-c", TOY_PROXY, str(port), ",".join(sims["prefill"]), ",".join(sims["decode"])]
        elif mode in PEER_MODES:
            cmd = peer_command(mode, port, free_port(), sims["prefill"], sims["decode"])
        else:
            raise SystemExit(f"unknown mode {mode}")
        if plus and extra in VARIANTS:
            cmd += VARIANTS[extra]
        elif plus:
            raise SystemExit(f"unknown variant +{extra} of {mode_name}")
        if n_workers:
            cmd += ["--workers", n_workers]
        cpu = "0" if not n_workers else f"0-{min(cpus(), int(n_workers)) - 1}"
        proc = procs.start(f"proxy-{mode_name}", cmd, cpu, env)
        wait_http(url + ("/health" if mode != "toy" else "/docs"), timeout=60)
        out["proxies"][mode_name] = (url, proc)
    from pdgate.urls import static_instance_id

    out["prefill_ids"] = {u: static_instance_id(u) for u in sims["prefill"]}
    return out


# `MODE+decider`: the decider and the KV-event index on (issue #22: router CPU per request at most +10%).
# The minimum of 0 tokens and a prefill never too busy send every request PD, so the work besides the
# decision is the plain mode's (at c=32 the prefill's load passes the default busy mark of 8); the
# ipc source that no engine publishes on gives cache_aware an index to look prompts up in; it holds nothing,
# so no prompt is hashed and the choice falls back to prefix affinity.
CACHE_ARGS = ["--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"]
CACHE_ARGS += ["--kv-events", "nobody=ipc:///tmp/pdgate-bench-no-kv-events.pub"]
DECIDER_ARGS = ["--disaggregation", "conditional", "--pd-min-tokens", "0", "--pd-prefill-busy-load", "1e9", *CACHE_ARGS]
# `MODE+policies`: the router's default policies (prefix affinity, least load), decider and index off: the
# baseline that `+decider` turns the two on from. `+affinity` (the decodes by prefix affinity, what cache_aware
# falls back to) and `+cacheonly` (cache_aware and the index, decider off) split the difference between them.
VARIANTS = {
    "decider": DECIDER_ARGS,
    "policies": ["--prefill-policy", "prefix_affinity", "--decode-policy", "least_load"],
    "affinity": ["--prefill-policy", "prefix_affinity", "--decode-policy", "prefix_affinity"],
    "cacheonly": CACHE_ARGS,
}
TOKEN_PROMPTS = 0  # --token-prompts N: prompts of N token ids instead of text

SCENARIOS_FULL = [
    ("nonstream", 1, 400, False, 16),
    ("nonstream", 32, 3000, False, 16),
    ("nonstream", 256, 3000, False, 16),
    ("nonstream", 1024, 4096, False, 16),
    ("nonstream", 4096, 8192, False, 16),
    ("stream32", 64, 2000, True, 32),
]
SCENARIOS_QUICK = [
    ("nonstream", 1, 150, False, 16),
    ("nonstream", 32, 1000, False, 16),
    ("nonstream", 256, 1000, False, 16),
    ("nonstream", 1024, 2048, False, 16),
    ("nonstream", 4096, 4096, False, 16),
    ("stream32", 64, 600, True, 32),
]


def run_scenarios(
    stack: dict[str, Any], modes: list[str], quick: bool, only: list[int] | None = None
) -> list[dict[str, Any]]:
    """Each scenario for each mode. Up to concurrency 256 the modes alternate in short rounds (in the
    order given, then reversed), so a change in the machine's background load hits them alike (the
    comparisons depend on it)."""
    rows = []
    scenarios = SCENARIOS_QUICK if quick else SCENARIOS_FULL
    direct = {
        "metaserver": stack["metaserver"],
        "prefill": stack["sims"]["prefill"],
        "decode": stack["sims"]["decode"],
        "prefill_ids": stack["prefill_ids"],
    }

    def measure(mode: str, conc: int, total: int, stream: bool, tokens: int) -> dict[str, Any]:
        url, pid = ("", None) if mode == "direct" else (stack["proxies"][mode][0], stack["proxies"][mode][1].pid)
        c0 = tree_cpu_seconds(pid) if pid else 0.0
        res = load(url, conc, total, stream, tokens, direct if mode == "direct" else None)
        res["cpu"] = tree_cpu_seconds(pid) - c0 if pid else None
        return res

    for name, conc, total, stream, tokens in scenarios:
        if only and conc not in only:
            continue
        active = [m for m in modes if not (m == "toy" and (conc > 32 or stream))]  # toy: a CPU reference only
        for mode in active:
            measure(mode, min(conc, 32), min(200, total), stream, tokens)  # warm-up
        rounds = 5 if conc == 1 else 3 if conc <= 256 else 1
        acc: dict[str, dict[str, Any]] = {
            m: {"lat": [], "ttft": [], "errors": [], "elapsed": 0.0, "cpu": 0.0} for m in active
        }
        for n in range(rounds):
            # Forward, then backward: the mode measured first in a round had the worse p99 in every run of
            # a lane A/B (docs/COMPARISON.md), so no mode keeps that place.
            for mode in active if n % 2 == 0 else active[::-1]:
                res = measure(mode, conc, total // rounds, stream, tokens)
                a = acc[mode]
                a["lat"] += res["lat"]
                a["ttft"] += res["ttft"]
                a["errors"] += res["errors"]
                a["elapsed"] += res["elapsed"]
                a["cpu"] = None if res["cpu"] is None else a["cpu"] + res["cpu"]
        for mode in active:
            a = acc[mode]
            done = (total // rounds) * rounds
            row = {
                "scenario": name,
                "mode": mode,
                "concurrency": conc,
                "requests": done,
                "ok": len(a["lat"]),
                "errors": len(a["errors"]),
                "req_s": len(a["lat"]) / a["elapsed"],
                "p50_ms": pct(a["lat"], 0.5) * 1e3,
                "p99_ms": pct(a["lat"], 0.99) * 1e3,
                "ttft_p50_ms": pct(a["ttft"], 0.5) * 1e3,
                "cpu_us_per_req": a["cpu"] / done * 1e6 if a["cpu"] is not None else None,
                "first_error": a["errors"][0] if a["errors"] else None,
            }
            rows.append(row)
            print_row(row)
    return rows


HEAD = (
    f"{'scenario':<10} {'mode':<13} {'conc':>5} {'reqs':>6} {'err':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'TTFT ms':>8} {'CPU us/req':>10}"
)


def print_row(r: dict[str, Any]) -> None:
    cpu = f"{r['cpu_us_per_req']:.0f}" if r["cpu_us_per_req"] is not None else "-"
    print(
        f"{r['scenario']:<10} {r['mode']:<13} {r['concurrency']:>5} {r['requests']:>6} {r['errors']:>4} "
        f"{r['req_s']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['ttft_p50_ms']:>8.2f} {cpu:>10}",
        flush=True,
    )


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def find(mode: str, scenario: str, conc: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["mode"], r["scenario"], r["concurrency"]) == (mode, scenario, conc)), None)

    out: dict[str, Any] = {}
    for mode in ("router", "isolated"):
        r32, s64 = find(mode, "nonstream", 32), find(mode, "stream32", 64)
        if r32:
            out[f"cpu_us_nonstream_c32[{mode}]"] = ("cpu_us_nonstream_c32", r32["cpu_us_per_req"])
        if s64:
            out[f"cpu_us_stream32[{mode}]"] = ("cpu_us_stream32", s64["cpu_us_per_req"])
        r1024 = find(mode, "nonstream", 1024)
        if r1024:
            out[f"errors_c1024[{mode}]"] = ("errors_c1024", r1024["errors"])
    r1, d1 = find("router", "nonstream", 1), find("direct", "nonstream", 1)
    if r1 and d1:
        out["added_p50_ms_c1[router-direct]"] = ("added_p50_ms_c1", r1["p50_ms"] - d1["p50_ms"])
    return {
        k: {"measured": v, "target": TARGETS[t], "met": v is not None and v <= TARGETS[t]} for k, (t, v) in out.items()
    }


def versus_peers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pdgate mode against the best Rust peer measured in the same run, scenario by scenario: the
    ratio of CPU per request and of p99 (below 1: pdgate is cheaper/faster), and req/s side by side."""
    out = []
    keys = sorted({(r["scenario"], r["concurrency"]) for r in rows}, key=lambda k: (k[0] != "nonstream", k[1]))
    for scenario, conc in keys:
        here = [r for r in rows if (r["scenario"], r["concurrency"]) == (scenario, conc)]
        peers = [r for r in here if r["mode"] in PEER_MODES and r["cpu_us_per_req"]]
        if not peers:
            continue
        best_cpu = min(peers, key=lambda r: r["cpu_us_per_req"])
        best_p99 = min(peers, key=lambda r: r["p99_ms"])
        for r in here:
            if r["mode"] in PEER_MODES or r["mode"] == "direct" or not r["cpu_us_per_req"]:
                continue
            out.append(
                {
                    "scenario": scenario,
                    "concurrency": conc,
                    "mode": r["mode"],
                    "cpu_ratio": r["cpu_us_per_req"] / best_cpu["cpu_us_per_req"],
                    "best_cpu_peer": best_cpu["mode"],
                    "p99_ratio": r["p99_ms"] / best_p99["p99_ms"],
                    "best_p99_peer": best_p99["mode"],
                    "req_s": r["req_s"],
                    "peer_req_s": {p["mode"]: p["req_s"] for p in peers},
                    "errors": r["errors"],
                    "peer_errors": {p["mode"]: p["errors"] for p in peers},
                }
            )
    return out


def print_versus(vs: list[dict[str, Any]]) -> None:
    print("\n== pdgate vs the best Rust peer of the same run (ratio < 1: pdgate cheaper / faster) ==")
    print(f"{'scenario':<10} {'conc':>5} {'mode':<13} {'CPU ratio':>9} {'p99 ratio':>9} {'req/s':>7}  peers req/s")
    for v in vs:
        peer = " ".join(f"{m}={x:.0f}" for m, x in v["peer_req_s"].items())
        print(
            f"{v['scenario']:<10} {v['concurrency']:>5} {v['mode']:<13} {v['cpu_ratio']:>9.2f} "
            f"{v['p99_ratio']:>9.2f} {v['req_s']:>7.0f}  {peer}"
        )


def profile(stack: dict[str, Any], mode: str, out: Path) -> None:
    """py-spy on `mode`'s proxy under non-streaming load at concurrency 32: the frames that cost the CPU."""
    url, proc = stack["proxies"][mode]
    load(url, 32, 500, False, 16)  # warm-up
    raw = LOGS / f"{out.stem}.raw"  # kept with the logs: the summary is what is committed
    spy = start_profile(proc.pid, 8, raw)
    time.sleep(0.5)
    c0, n, errors = tree_cpu_seconds(proc.pid), 0, 0
    while spy.poll() is None:  # load for as long as py-spy samples
        res = load(url, 32, 2000, False, 16)
        n, errors = n + len(res["lat"]), errors + len(res["errors"])
    cpu = tree_cpu_seconds(proc.pid) - c0
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    head = f"py-spy record --format raw --rate 250, {mode} at c=32 non-streaming, 16 tokens ({when} UTC)\n"
    head += f"{n} requests, {errors} errors, {cpu / max(n, 1) * 1e6:.0f} us CPU/request (py-spy running)\n"
    out.write_text(head + summarize_profile(raw))
    print(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per scenario")
    ap.add_argument("--token-prompts", type=int, default=0, metavar="N", help="prompts of N token ids, not text")
    ap.add_argument("--libs", action="store_true", help="also measure HTTP clients, ASGI stacks, JSON libraries")
    ap.add_argument("--modes", nargs="+", default=["router", "direct", "isolated", "embedded", "toy", *PEER_MODES])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router.json"))
    ap.add_argument("--pin", action="store_true", help="taskset: proxies on CPU 0, everything else on the others")
    ap.add_argument("--only", nargs="+", type=int, help="run only the scenarios with these concurrencies")
    ap.add_argument("--baseline", metavar="DIR", help="package tree (DIR/pdgate/...) for the modes named MODE@base")
    ap.add_argument("--profile", metavar="FILE", help="py-spy the first mode at c=32 non-streaming; summary to FILE")
    args = ap.parse_args()
    global TOKEN_PROMPTS
    TOKEN_PROMPTS = args.token_prompts
    pin: bool = args.pin
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    info = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpus": cpus(),
        "load_avg_before": os.getloadavg(),
        "pinning": "proxies on CPU 0, sims/metaserver/client on the others" if pin and cpus() > 1 else "none",
    }
    libs = measure_libs() if args.libs else None
    procs = Procs(pin)
    try:
        stack = start_stack(procs, args.modes, args.baseline)
        if pin and cpus() > 1:  # the load generator stays off the proxies' CPU
            os.sched_setaffinity(0, set(range(1, cpus())))
        print(f"\n== router benchmark ({'quick' if args.quick else 'full'}), logs in {LOGS} ==")
        if args.profile:
            profile(stack, args.modes[0], Path(args.profile))
            return
        print(HEAD)
        rows = run_scenarios(stack, args.modes, args.quick, args.only)
    finally:
        procs.stop()
    info["load_avg_after"] = os.getloadavg()
    v = verdicts(rows)
    print("\n== targets ==")
    for k, item in v.items():
        verdict = "met" if item["met"] else "NOT met"
        print(f"{k:<34} measured {item['measured']:>10.2f}  target {item['target']:>6}  {verdict}")
    vs = versus_peers(rows)
    if vs:
        print_versus(vs)
    out = {"info": info, "libs": libs, "rows": rows, "targets": v, "versus_peers": vs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""W4 on 2P2D: multi-turn conversations routed round robin against routed by the engines' KV events
(issue #22's W4 target: with KV events, TTFT p50 <= 0.6x round-robin PD at the same rate, and KV moved per
turn <= 0.3x a full-prompt transfer).

Why its own bench, beside `bench/goodput.py`: on 1P1D every policy picks the same pair, so what prefix-aware
routing buys only shows with a choice to make. One `LocalStack` of 2 prefills and 2 decodes (unpinned: four
engines on two cores, the same for every setup) whose engines publish their KV events; one router per setup
on the same engines (the first router's embedded metaserver serves them all), taking turns in two blocks of
half the conversations each, the second block in reverse order (A B C C B A), so the host's drift falls on
every setup alike:

  round-robin    PD for every turn, prefill and decode round robin (`--prefill-policy round_robin
                 --decode-policy round_robin`): what a prefix-blind gateway does
  kv-events      PD for every turn, `cache_aware` on both sides following the engines' KV events: the turn
                 goes to the prefill and the decode that hold the conversation's blocks
  kv-conditional the same, with `--disaggregation conditional`: a turn whose non-cached part is short stays
                 whole where its prefix lives

Load: conversations arrive as a Poisson process at `--rate` per second; each has `--turns` turns, sent one
after another as soon as the previous answer ends: turn 1 is `--first` random token ids, each next turn the
previous prompt, its answer (64 tokens, greedy, `ignore_eos`) and `--grow` new random ids. Token-id
prompts: the router hashes them into the engines' block keys (a text prompt would fall back to prefix
affinity, as `router/policies/cache_aware.py` says). Each setup gets its own conversations (other seeds), so
no setup finds another's blocks in the caches.

Measured per request: TTFT (first streamed token), the tokens the decode loaded for it (the decode's
connector logs "transfer <x-request-id>: ... loaded N tokens"; a full-prompt transfer is prompt - 1), and
the path. Prints a table and writes bench/results/multiturn.json.

    .venv-vllm/bin/python bench/multiturn.py [--rate 0.5] [--conversations 12] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from pdgate.deploy.local import kv_events
from pdgate.deploy.local.procs import ManagedProcess, free_port, stop_all
from pdgate.deploy.local.stack import LocalStack, StackConfig, wait_router_ready
from pdgate.deploy.local.vllm_env import repo_root

from bench.multiturn_report import SETUPS, Turn, loaded_tokens, summarize, table

OUT = Path(__file__).resolve().parent / "results" / "multiturn.json"
OUTPUT_TOKENS = 64
VOCAB = (3, 2047)  # the tiny model's ordinary token ids


def router_flags(setup: str) -> list[str]:
    if setup == "round-robin":
        return ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    flags = ["--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"]
    if setup == "kv-conditional":
        flags += ["--disaggregation", "conditional"]
    return flags


def start_router(stack: LocalStack, setup: str, run_dir: Path) -> tuple[ManagedProcess, str]:
    """A router on the stack's engines (their registry and ledger at the stack's metaserver)."""
    port = free_port()
    argv = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metaserver", stack.metaserver_url, "--health-timeout-s", "15", *router_flags(setup)]
    if setup != "round-robin":
        argv += kv_events.router_args(stack.kv_event_ports)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDGATE_ROUTER_METASERVER_TOKEN": stack.admin_token}
    proc = ManagedProcess(f"router-{setup}", argv, log_path=run_dir / f"router-{setup}.log", env=env, cwd=repo_root())
    proc.start()
    url = f"http://127.0.0.1:{port}"
    wait_router_ready(proc, url, print, [h.proc for h in stack.instances])
    return proc, url


async def one_turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> tuple[Turn, list[int]]:
    """One streamed completion: its TTFT, its answer's token ids, its request id and path."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    answer: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:200]
            return Turn(len(prompt), None, 0, "", "", f"{resp.status_code} {text}"), []
        rid = resp.headers.get("x-request-id", "")
        path = resp.headers.get("x-pdgate-path", "pd")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                answer += ids
    ok = len(answer) == OUTPUT_TOKENS
    return Turn(len(prompt), ttft, len(answer), rid, path, "" if ok else f"{len(answer)} tokens"), answer


async def conversation(
    client: httpx.AsyncClient, url: str, model: str, rng: random.Random, args: argparse.Namespace, k: int
) -> list[Turn]:
    prompt = [rng.randint(*VOCAB) for _ in range(args.first)]
    turns: list[Turn] = []
    for n in range(args.turns):
        turn, answer = await one_turn(client, url, model, prompt)
        turns.append(turn.numbered(k, n + 1))
        if turn.error:
            break
        prompt = prompt + answer + [rng.randint(*VOCAB) for _ in range(args.grow)]
    return turns


async def drive(
    url: str, model: str, args: argparse.Namespace, seed: int, n: int, first_k: int = 0
) -> tuple[list[Turn], float]:
    """`n` conversations arriving as a Poisson process at `args.rate`, each its turns one after another."""
    rng = random.Random(seed)
    starts: list[float] = []
    t = 0.0
    for _ in range(n):
        starts.append(t)
        t += rng.expovariate(args.rate)
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits, trust_env=False) as client:
        t0 = time.monotonic()

        async def later(k: int, at: float) -> list[Turn]:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            return await conversation(client, url, model, random.Random(seed * 1000 + k), args, first_k + k)

        done = await asyncio.gather(*(later(k, at) for k, at in enumerate(starts)))
        took = time.monotonic() - t0
    return [t for conv in done for t in conv], took


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--rate", type=float, default=0.5, help="conversations started per second (Poisson)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=832, help="turn 1's prompt tokens (W4: 512 + 320)")
    ap.add_argument("--grow", type=int, default=320, help="new tokens per later turn")
    ap.add_argument("--venv", default=str(repo_root() / ".venv-vllm"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t_start = time.time()
    run_dir = Path(f"/tmp/pdgate-multiturn-{int(t_start)}")
    cfg = StackConfig(
        n_prefill=2,
        n_decode=2,
        port=free_port(),
        run_dir=run_dir,
        venv=Path(args.venv),
        install=False,
        kv_events=True,
        router_args=("--health-timeout-s", "15"),
    )
    results: dict[str, Any] = {}
    # Two blocks per setup, the second in reverse order (A B C C B A): the host's drift over the run (its
    # load average climbs from ~1 to ~20 as the caches fill) falls on every setup alike, not on the last.
    half = max(1, args.conversations // 2)
    order = [(s, 0) for s in args.setups] + [(s, 1) for s in reversed(args.setups)]
    with LocalStack(cfg) as stack:
        decode_logs = [h.log_path for h in stack.by_role("decode")]
        routers = {setup: start_router(stack, setup, run_dir) for setup in args.setups}
        try:
            for setup, block in order:
                i = args.setups.index(setup)
                url = routers[setup][1]
                load_before = load_average()
                turns, took = asyncio.run(drive(url, cfg.model_name, args, 100 + i + 50 * block, half, half * block))
                time.sleep(1.0)  # the decodes' last log lines
                entry = results.setdefault(setup, {"turns": [], "took_s": 0.0, "load": []})
                entry["turns"] += turns
                entry["took_s"] += took
                entry["load"].append([load_before, load_average()])
                print(f"{setup} (block {block + 1}): {len(turns)} requests in {took:.1f} s", flush=True)
        finally:
            stop_all([proc for proc, _ in routers.values()])
        loaded = loaded_tokens(p.read_text(errors="replace") for p in decode_logs)
        for entry in results.values():
            turns = [t.with_loaded(loaded.get(t.rid)) for t in entry["turns"]]
            entry["summary"] = summarize(turns)
            entry["load_before"], entry["load_after"] = entry["load"][0][0], entry["load"][-1][1]
            entry["turns"] = [t.as_dict() for t in turns]
    doc = {
        "what": "bench/multiturn.py: W4 multi-turn on 2P2D, round robin against KV-event routing, same engines",
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)),
        "minutes": (time.time() - t_start) / 60,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: v for k, v in vars(args).items() if k not in ("venv", "out")},
        "setups": results,
    }
    print(table(doc))
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

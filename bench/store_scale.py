"""What the ledger costs Redis, per PD request and per shard, on one Redis, Sentinel and a Redis Cluster.

For each topology this starts real redis-server processes on loopback (the same helpers the tests use:
`tests.store_ha.servers`), opens the production `RedisStore` on its URL and runs full handoffs through
it, as the metaserver does for each PD request: create -> ready -> claim -> done, while one long-poll
reader per prefill drains its event feed (XREAD BLOCK), the way connectors do. It reads the servers'
own counters before and after (INFO commandstats, stats, cpu), so the numbers are Redis's, not ours:

  * commands and bytes (in + out) per PD request;
  * Redis CPU per request, hence handoffs per second one shard (one Redis core) can carry;
  * the sweeper's fixed cost (expire_due every 100 ms, idle) in commands per second per replica;
  * the throughput this one client process reached (client-bound on a small machine; see docs/SCALE.md).

    .venv-vllm/bin/python bench/store_scale.py [--handoffs 3000] [--concurrency 64] [--prefills 30]
        [--topologies single sentinel sentinel-wait cluster]

Prints a table and writes bench/results/store_scale.json. Topologies: `single` (redis://), `sentinel`
(redis+sentinel://, asynchronous replication to one replica), `sentinel-wait` (the same with
wait_replicas=1: each write batch waits for the replica) and `cluster` (redis+cluster://, three masters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from pdgate.metaserver.store import open_store  # noqa: E402
from pdgate.metaserver.store.redis import RedisStore  # noqa: E402

from pdgate.models import HandoffCreate, KVLocation  # noqa: E402
from tests.store_ha.servers import RedisClusterServers, SentinelGroup  # noqa: E402
from tests.support.redis import RedisServer  # noqa: E402

TOPOLOGIES = ("single", "sentinel", "sentinel-wait", "cluster")
LOC = KVLocation(block_ids=[list(range(16))], num_tokens=2048, engine_id="eng-p", host="10.0.0.1")


@contextmanager
def topology(name: str) -> Any:
    """(store URL builder, data-server ports) for a freshly started topology; stopped on exit."""
    if name == "single":
        with RedisServer() as server:
            yield (lambda p: f"{server.url}?prefix={p}"), [server.port]
    elif name.startswith("sentinel"):
        group = SentinelGroup().start()
        extra = "&wait_replicas=1&wait_timeout_ms=1000" if name == "sentinel-wait" else ""
        try:
            yield (lambda p: group.url(p) + extra), [group.master.port]
        finally:
            group.close()
    else:
        cluster = RedisClusterServers().start()
        try:
            yield (lambda p: cluster.url(p)), cluster.ports
        finally:
            cluster.close()


def snapshot(ports: list[int]) -> dict[str, float]:
    """Summed counters of the data servers: calls per command, bytes in/out, CPU seconds."""
    out: dict[str, float] = {}
    for port in ports:
        with redis.Redis(port=port, decode_responses=True) as r:
            stats = r.info("commandstats")
            for cmd, v in stats.items():
                out[cmd] = out.get(cmd, 0) + v["calls"]
            s = r.info("stats")
            c = r.info("cpu")
            out["net_in"] = out.get("net_in", 0) + s["total_net_input_bytes"]
            out["net_out"] = out.get("net_out", 0) + s["total_net_output_bytes"]
            # Replication traffic is not the ledger's clients' cost; it is reported separately.
            out["repl_out"] = out.get("repl_out", 0) + s.get("total_net_repl_output_bytes", 0)
            out["cpu_s"] = out.get("cpu_s", 0) + c["used_cpu_user"] + c["used_cpu_sys"]
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


async def run_handoffs(store: RedisStore, n: int, concurrency: int, prefills: list[str], tag: str) -> float:
    """n full handoffs, `concurrency` at a time, with one event reader per prefill; wall seconds."""
    stop = asyncio.Event()
    all_seen = asyncio.Event()
    seen = 0

    async def reader(p: str) -> None:
        nonlocal seen
        cursor = None
        while not stop.is_set():
            page = await store.read_events(p, cursor, wait=0.2)
            cursor = page.cursor
            seen += len(page.events)
            if seen >= n:
                all_seen.set()

    async def one(i: int) -> None:
        tid = f"{tag}-{i}"
        now = time.time()
        body = HandoffCreate(prefill_instance_id=prefills[i % len(prefills)])
        await store.create_handoff(body, transfer_id=tid, now=now, pending_lease_s=60, ready_lease_s=60)
        await store.mark_ready(tid, LOC, now=now)
        await store.claim(tid, "decode-0", now=now, lease_s=60)
        await store.done(tid, "decode-0", now=now)

    readers = [asyncio.create_task(reader(p)) for p in prefills]
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    start = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(n)))
    await all_seen.wait()  # every DONE reached its prefill's feed
    wall = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*readers)
    return wall


async def sweeper_cost(store: RedisStore, ports: list[int], seconds: float) -> float:
    """Commands per second one idle metaserver replica's sweeper sends (expire_due every 100 ms)."""
    before = snapshot(ports)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await store.expire_due(now=time.time())
        await asyncio.sleep(0.1)
    d = diff(snapshot(ports), before)
    calls = sum(v for k, v in d.items() if k.startswith("cmdstat_") and k != "cmdstat_info")
    return calls / seconds


async def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cm: AbstractContextManager[tuple[Callable[[str], str], list[int]]] = topology(name)
    with cm as (url_for, ports):
        store = open_store(url_for(f"b{uuid.uuid4().hex[:8]}"))
        assert isinstance(store, RedisStore)
        prefills = [f"prefill-{i}" for i in range(args.prefills)]
        try:
            await run_handoffs(store, min(300, args.handoffs), args.concurrency, prefills, "warm")
            before, cpu0 = snapshot(ports), time.process_time()
            wall = await run_handoffs(store, args.handoffs, args.concurrency, prefills, "run")
            client_cpu = time.process_time() - cpu0
            d = diff(snapshot(ports), before)
            sweep = await sweeper_cost(store, ports, 2.0)
        finally:
            await store.close()
    n = args.handoffs
    # INFO/snapshot calls of this bench itself are left out of the per-request numbers.
    commands = {k.removeprefix("cmdstat_"): v / n for k, v in d.items() if k.startswith("cmdstat_")}
    commands.pop("info", None)
    redis_cpu_ms = 1000 * d.get("cpu_s", 0) / n
    # Round trips this client made: scripts never send EVALSHA, XREAD or COMMAND; the create script runs
    # one GET and one SET itself (the kv_key counter), so any more are the cluster's locator.
    c = commands.get
    trips = c("evalsha", 0) + c("xread", 0) + c("command|getkeys", 0)
    trips += max(0.0, c("set", 0) - 1) + max(0.0, c("get", 0) - 1)
    return {
        "topology": name,
        "data_servers": len(ports),
        "handoffs": n,
        "concurrency": args.concurrency,
        "prefills": args.prefills,
        "commands_per_request": round(sum(commands.values()), 2),
        "client_calls_per_request": round(trips, 2),
        "commands_by_name": {k: round(v, 3) for k, v in sorted(commands.items())},
        "bytes_in_per_request": round(d.get("net_in", 0) / n),
        "bytes_out_per_request": round((d.get("net_out", 0) - d.get("repl_out", 0)) / n),
        "replication_bytes_per_request": round(d.get("repl_out", 0) / n),
        "redis_cpu_ms_per_request": round(redis_cpu_ms, 4),
        "handoffs_per_s_per_shard_core": round(1000 / redis_cpu_ms) if redis_cpu_ms else None,
        "client_handoffs_per_s": round(n / wall),
        "client_cpu_ms_per_request": round(1000 * client_cpu / n, 3),
        "sweeper_commands_per_s_idle": round(sweep, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--handoffs", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prefills", type=int, default=30)
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=TOPOLOGIES)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "store_scale.json")
    args = ap.parse_args()
    rows = [asyncio.run(measure(name, args)) for name in args.topologies]
    head = (
        f"{'topology':<14} {'cmds/req':>8} {'calls/req':>9} {'B in/req':>8} {'B out/req':>9} {'repl B/req':>10} "
        f"{'redis ms/req':>12} {'/s per shard':>12} {'client /s':>9} {'sweep cmd/s':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['topology']:<14} {r['commands_per_request']:>8} {r['client_calls_per_request']:>9} "
            f"{r['bytes_in_per_request']:>8} "
            f"{r['bytes_out_per_request']:>9} {r['replication_bytes_per_request']:>10} "
            f"{r['redis_cpu_ms_per_request']:>12} {r['handoffs_per_s_per_shard_core']!s:>12} "
            f"{r['client_handoffs_per_s']:>9} {r['sweeper_commands_per_s_idle']:>11}"
        )
    for r in rows:
        print(f"{r['topology']}: {r['commands_by_name']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": _cpus()}
    doc = {"benchmark": "store cost per PD request (bench/store_scale.py)", "machine": machine, "runs": rows}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()

"""Benchmark: the decode's claim latency through the connector's control thread, idle and busy engine.

Why: inside vLLM the control thread shares the GIL with the engine loop, which runs Python almost all
the time. Every time the control thread gives the GIL up (each event-loop turn's epoll, each socket
send or recv) it must win it back, and a thread holding the GIL in a loop gives it up only when the
waiter has waited the switch interval (5 ms by default). So a claim costs about (GIL re-acquisitions
per call) x (switch interval) under load, whatever the network does. This bench measures it.

The "engine" is this process's main thread, as in vLLM: it submits `Claim` commands and drains results
between steps. Idle: it sleeps between drains (the GIL is free). Busy: it runs a pure-Python loop
between drains and never sleeps (an honest stand-in for the engine loop). The metaserver is a real
`python -m pdgate.metaserver` process (memory store), so only the client side shares our GIL.

Per configuration it reports the claim latency (submit -> result seen by the engine thread) p50/p90/p99,
the control thread's context switches per claim (each one is a GIL hand-over it waited for, or a block
on I/O), and a burst of 32 claims submitted at once (how many batch requests carried them).
Configurations: the HTTP client (`httpx`: MetaClient as shipped; `pool`: the router's httptools
keep-alive client, `pdgate.meta_pooled.PooledMetaClient`; `process`: the control thread with the `pool` client
in a child process, `connector.control_process.ControlProcess`) x the interpreter's switch interval.
The first claim of each configuration is a warm-up (connections, the child process) and not counted.

    .venv-vllm/bin/python bench/control.py [--claims 60] [--out bench/results/control.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdgate.connector.config import ConnectorConfig  # noqa: E402
from pdgate.connector.control import ControlThread  # noqa: E402
from pdgate.connector.control_process import ControlProcess  # noqa: E402
from pdgate.connector.messages import Claim, Claimed, ClaimFailed  # noqa: E402

from pdgate.http_pool import HttpPool  # noqa: E402
from pdgate.meta_client import MetaClient  # noqa: E402
from pdgate.meta_pooled import PooledMetaClient  # noqa: E402
from pdgate.models import BatchCreate, BatchReady, KVLocation  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.servers import wait_http  # noqa: E402

LOCATION = KVLocation(block_ids=[list(range(64))], num_tokens=1024, engine_id="p0", host="10.0.0.5")
BURST = 32


def clients(url: str) -> dict[str, Callable[[], MetaClient]]:
    return {
        "httpx": lambda: MetaClient(url, timeout=5.0),
        "pool": lambda: PooledMetaClient(url, pool=HttpPool(), timeout=5.0),
    }


def ctx_switches(native_id: int | None) -> int:
    """Voluntary + involuntary context switches of one thread (Linux), -1 when unknown."""
    if native_id is None:
        return -1
    try:
        text = Path(f"/proc/self/task/{native_id}/status").read_text()
    except OSError:
        return -1
    return sum(
        int(line.split()[1])
        for line in text.splitlines()
        if line.endswith(tuple("0123456789")) and "ctxt_switches" in line
    )


def prepare(url: str, n: int, tag: str) -> list[str]:
    """n handoffs, READY, through one batch (the setup is not measured)."""
    ids = [f"{tag}-{i}" for i in range(n)]

    async def run() -> None:
        async with MetaClient(url) as c:
            await c.batch([BatchCreate(prefill_instance_id="p0", transfer_id=t) for t in ids])
            await c.batch([BatchReady(transfer_id=t, location=LOCATION) for t in ids])

    asyncio.run(run())
    return ids


def step(busy: bool) -> None:
    """One engine step between two drains: ~200 us of pure Python (busy) or a sleep (idle)."""
    if busy:
        x = 0
        end = time.perf_counter() + 0.0002
        while time.perf_counter() < end:
            x += 1
    else:
        time.sleep(0.0002)


Control = ControlThread | ControlProcess


def wait(control: Control, want: set[str], busy: bool, timeout: float = 30.0) -> dict[str, float]:
    """Step until every transfer in `want` has its claim result; when each was seen."""
    seen: dict[str, float] = {}
    until = time.perf_counter() + timeout
    while len(seen) < len(want) and time.perf_counter() < until:
        for r in control.drain():
            if isinstance(r, (Claimed, ClaimFailed)) and r.transfer_id in want:
                if isinstance(r, ClaimFailed):
                    raise RuntimeError(f"claim failed: {r}")
                seen[r.transfer_id] = time.perf_counter()
        step(busy)
    if len(seen) < len(want):
        raise RuntimeError(f"{len(want) - len(seen)} claims unanswered")
    return seen


def measure(url: str, client: str, switch_s: float, busy: bool, claims: int) -> dict[str, Any]:
    tag = f"{client}-{switch_s}-{busy}-{time.time_ns()}"
    ids = prepare(url, 1 + claims + BURST, tag)
    cfg = ConnectorConfig(
        metaserver_url=url, instance_id="d0", url="http://127.0.0.1:8200", model="tiny", role="decode"
    )
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    control: Control
    if client == "process":
        control = ControlProcess(cfg)
        native = None
    else:
        control = ControlThread(cfg, client_factory=clients(url)[client])
        native = control._thread.native_id
    try:
        lat: list[float] = []
        switches = 0
        control.submit([Claim(ids[0])])  # warm: the child process starts, connections open
        wait(control, {ids[0]}, False)
        for tid in ids[1 : claims + 1]:
            before = ctx_switches(native)
            t0 = time.perf_counter()
            control.submit([Claim(tid)])
            lat.append(wait(control, {tid}, busy)[tid] - t0)
            switches += ctx_switches(native) - before
        requests0 = control.batcher.requests if isinstance(control, ControlThread) else 0
        burst_ids = ids[claims + 1 :]
        t0 = time.perf_counter()
        control.submit([Claim(t) for t in burst_ids])
        seen = wait(control, set(burst_ids), busy)
        burst_ms = (max(seen.values()) - t0) * 1000.0
        burst_requests = control.batcher.requests - requests0 if isinstance(control, ControlThread) else -1
    finally:
        control.close(timeout=2.0)
        sys.setswitchinterval(previous)
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000.0

    return {
        "client": client,
        "switch_interval_ms": switch_s * 1000.0,
        "engine": "busy" if busy else "idle",
        "claims": len(lat),
        "p50_ms": pct(0.5),
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
        "max_ms": lat[-1] * 1000.0,
        "ctx_switches_per_claim": switches / len(lat) if native is not None else None,
        "burst": {"claims": BURST, "all_answered_ms": burst_ms, "requests": burst_requests},
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'client':<6} {'switch ms':>9} {'engine':<6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'ctxsw/claim':>11} {'burst32 ms':>10} {'burst reqs':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['client']:<6} {r['switch_interval_ms']:>9.1f} {r['engine']:<6} {r['p50_ms']:>8.2f} "
            f"{r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f} "
            f"{r['ctx_switches_per_claim'] or float('nan'):>11.1f} "
            f"{r['burst']['all_answered_ms']:>10.1f} {r['burst']['requests']:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--claims", type=int, default=60, help="single claims measured per configuration")
    ap.add_argument("--clients", nargs="+", default=["httpx", "pool", "process"], choices=["httpx", "pool", "process"])
    ap.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "control.json")
    args = ap.parse_args(argv)

    port = free_port()
    cmd = [sys.executable, "-m", "pdgate.metaserver", "--port", str(port), "--store", "memory://"]
    server = subprocess.Popen([*cmd, "--log-level", "warning"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        wait_http(f"{url}/health", timeout=30)
        for client in args.clients:
            for switch_ms in args.switch_ms:
                for busy in (False, True):
                    row = measure(url, client, switch_ms / 1000.0, busy, args.claims)
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print()
    print(table(rows))
    report = {
        "benchmark": "decode claim latency through the connector control thread (submit -> result drained)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "engine_step": "200 us between drains: pure-Python loop (busy) or sleep (idle)",
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""Benchmark of the metaserver's hot path: full handoffs per second through HTTP.

One handoff = create -> ready -> claim -> done (four ledger calls). Two modes:
  * `single`: each call is its own HTTP request (what every caller did before batching);
  * `batched` (the full handoff as pdgate runs it now): each client process sends its calls through an
    auto-batcher like `pdgate.batcher.Batcher` (the router's create/claim and the connectors'
    ready/done): every call waiting when a request goes out rides in one `POST /v1/handoffs/batch`, at
    most two requests out per process. Latency is still per call, from the caller's side (queued ->
    answered), so the batching wait is in it. The metaserver runs as a real
`python -m pdgate.metaserver` process (uvicorn with uvloop + httptools), pinned to one core with taskset when
the machine has more than one; load comes from separate client processes pinned to the other cores,
each a tiny keep-alive HTTP/1.1 client on uvloop (no framework, so the client is not the bottleneck).
For each store (memory, redis) and concurrency (1, 32, 256) it prints a table and writes
bench/results/metaserver.json; a `redis-benchmark` run on the same redis-server gives the ceiling.

    .venv/bin/python bench/metaserver.py [--duration 5] [--concurrency 1 32 256] [--stores memory redis]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402
from tests.support.redis import RedisServer  # noqa: E402
from tests.support.servers import wait_http  # noqa: E402

CALLS = ("create", "ready", "claim", "done")
MODES = ("single", "batched")
BATCH_IN_FLIGHT = 2
READY_BODY = json.dumps(
    {
        "block_ids": [list(range(64))],
        "num_tokens": 1024,
        "engine_id": "engine-0",
        "host": "10.0.0.5",
        "tp_size": 1,
        "block_size": 16,
        "transport": "nixl",
        "transport_addresses": [{"tp_rank": 0, "host": "10.0.0.5", "port": 5600}],
    }
).encode()


# -- load generator (runs in child processes) --------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection; requests are sequential on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.r, self.w, self.host = reader, writer, host

    async def call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.w.write(head + body)
        status_line = await self.r.readline()
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        while True:
            line = await self.r.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, await self.r.readexactly(length) if length else b""


Step = tuple[str, Any, int]  # (the call's name in the latency table, what is sent, the status it must get)


async def _lifecycles(
    steps: Callable[[int], tuple[Step, ...]],
    call: Callable[[Any], Awaitable[int]],
    stop_at: float,
    warm_until: float,
    lat: dict[str, list[float]],
) -> tuple[int, int]:
    """One worker's handoffs, `steps(n)` for the n-th, each step sent by `call`, until `stop_at`; returns
    (completed, failed) among those begun after `warm_until`. The one loop of both modes, so that they
    time and count the same thing and differ only in how a call travels."""
    done = errors = n = 0
    clock = time.perf_counter
    while True:
        now = clock()
        if now >= stop_at:
            break
        n += 1
        ok = True
        measured = now >= warm_until
        for name, what, want in steps(n):
            t = clock()
            status = await call(what)
            if measured:
                lat[name].append(clock() - t)
            if status != want:
                ok = False
                break
        if measured:
            if ok:
                done += 1
            else:
                errors += 1
    return done, errors


async def _worker(
    host: str, port: int, tag: str, stop_at: float, warm_until: float, lat: dict[str, list[float]]
) -> tuple[int, int]:
    reader, writer = await asyncio.open_connection(host, port)
    conn = Conn(reader, writer, f"{host}:{port}")

    def steps(n: int) -> tuple[Step, ...]:
        tid = f"{tag}-{n}"
        return (
            (
                "create",
                ("POST", "/v1/handoffs", b'{"prefill_instance_id":"p0","transfer_id":"%s"}' % tid.encode()),
                201,
            ),
            ("ready", ("PUT", f"/v1/handoffs/{tid}/ready", READY_BODY), 200),
            ("claim", ("POST", f"/v1/handoffs/{tid}/claim", b'{"decode_instance_id":"d0"}'), 200),
            ("done", ("POST", f"/v1/handoffs/{tid}/done", b'{"decode_instance_id":"d0"}'), 200),
        )

    async def call(request: tuple[str, str, bytes]) -> int:
        status, _ = await conn.call(*request)
        return status

    try:
        return await _lifecycles(steps, call, stop_at, warm_until, lat)
    finally:
        writer.close()


class Batcher:
    """The bench's twin of `pdgate.batcher.Batcher` on the raw client (no models: the load
    generator must not be the bottleneck): calls queued in one loop turn, or while `BATCH_IN_FLIGHT`
    requests are out, ride in one batch request; each caller gets its item's status."""

    def __init__(self, conns: list[Conn]) -> None:
        self.idle = conns
        self.queue: list[tuple[bytes, asyncio.Future[int]]] = []
        self.scheduled = False
        self.sizes: list[int] = []
        self.tasks: set[asyncio.Future[None]] = set()

    def call(self, item: bytes) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.queue.append((item, fut))
        self._schedule()
        return fut

    def _schedule(self) -> None:
        if not self.scheduled and self.queue and self.idle:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        while self.queue and self.idle:
            batch, self.queue = self.queue[:512], self.queue[512:]
            task = asyncio.ensure_future(self._send(self.idle.pop(), batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _send(self, conn: Conn, batch: list[tuple[bytes, asyncio.Future[int]]]) -> None:
        self.sizes.append(len(batch))
        body = b'{"items":[' + b",".join(item for item, _ in batch) + b"]}"
        status, raw = await conn.call("POST", "/v1/handoffs/batch", body)
        self.idle.append(conn)
        self._schedule()
        results = json.loads(raw)["results"] if status == 200 else [{"status": status}] * len(batch)
        for (_, fut), result in zip(batch, results, strict=True):
            fut.set_result(result["status"])


async def _batched_worker(
    batcher: Batcher, tag: str, stop_at: float, warm_until: float, lat: dict[str, list[float]]
) -> tuple[int, int]:
    ready_item = b'"location":' + READY_BODY

    def steps(n: int) -> tuple[Step, ...]:
        tid = f"{tag}-{n}".encode()
        return (
            ("create", b'{"op":"create","prefill_instance_id":"p0","transfer_id":"%s"}' % tid, 201),
            ("ready", b'{"op":"ready","transfer_id":"%s",%s}' % (tid, ready_item), 200),
            ("claim", b'{"op":"claim","transfer_id":"%s","decode_instance_id":"d0"}' % tid, 200),
            ("done", b'{"op":"done","transfer_id":"%s","decode_instance_id":"d0"}' % tid, 200),
        )

    return await _lifecycles(steps, batcher.call, stop_at, warm_until, lat)


def _client_process(
    host: str,
    port: int,
    workers: int,
    proc_id: int,
    start_at: float,
    warmup: float,
    duration: float,
    out: Any,
    mode: str = "single",
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> dict[str, Any]:
        lat: dict[str, list[float]] = {c: [] for c in CALLS}
        await asyncio.sleep(max(0.0, start_at - time.time()))
        base = time.perf_counter()
        warm_until, stop_at = base + warmup, base + warmup + duration
        tags = [f"b{proc_id}x{w}x{os.getpid()}x{int(start_at * 1000)}" for w in range(workers)]
        sizes: list[int] = []
        if mode == "batched":
            conns = []
            for _ in range(int(os.environ.get("PDGATE_BENCH_BATCH_IN_FLIGHT", BATCH_IN_FLIGHT))):
                reader, writer = await asyncio.open_connection(host, port)
                conns.append(Conn(reader, writer, f"{host}:{port}"))
            batcher = Batcher(conns)
            results = await asyncio.gather(*(_batched_worker(batcher, t, stop_at, warm_until, lat) for t in tags))
            sizes = batcher.sizes
        else:
            results = await asyncio.gather(*(_worker(host, port, t, stop_at, warm_until, lat) for t in tags))
        return {
            "done": sum(r[0] for r in results),
            "errors": sum(r[1] for r in results),
            "lat": lat,
            "requests": len(sizes),
            "items": sum(sizes),
        }

    out.put(asyncio.run(run()))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc), to price each handoff in CPU."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(
    port: int,
    concurrency: int,
    duration: float,
    warmup: float,
    client_cpus: list[int] | None,
    watch: dict[str, int] | None = None,
    mode: str = "single",
) -> dict[str, Any]:
    procs_n = max(1, min(concurrency, 2 if client_cpus is None else max(2, len(client_cpus))))
    per = [concurrency // procs_n + (1 if i < concurrency % procs_n else 0) for i in range(procs_n)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 1.5  # lets every process start before the clock runs
    procs = []
    for i, workers in enumerate(per):
        args = ("127.0.0.1", port, workers, i, start_at, warmup, duration, queue, mode)
        p = ctx.Process(target=_client_process, args=args)
        p.start()
        if client_cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(p.pid, client_cpus)
        procs.append(p)
    watch = watch or {}
    # CPU is sampled over the whole run (warm-up included) and divided by every handoff started in it, so
    # the price per handoff holds even when other work shares the machine.
    cpu0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
    parts = [queue.get(timeout=duration + warmup + 120) for _ in procs]
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in watch.items()}
    for p in procs:
        p.join()
    lat = {c: [x for part in parts for x in part["lat"][c]] for c in CALLS}
    done = sum(p["done"] for p in parts)
    requests = sum(p["requests"] for p in parts)
    return {
        "mode": mode,
        "concurrency": concurrency,
        "items_per_batch": sum(p["items"] for p in parts) / requests if requests else None,
        "client_processes": procs_n,
        "handoffs": done,
        "errors": sum(p["errors"] for p in parts),
        "handoffs_per_s": done / duration,
        "cpu_ms_per_handoff": {
            name: 1000.0 * used / max(1, done * (duration + warmup) / duration) for name, used in cpu.items()
        },
        "calls": {c: {"p50_ms": _pct(lat[c], 0.50), "p99_ms": _pct(lat[c], 0.99), "n": len(lat[c])} for c in CALLS},
        "p99_ms_worst_call": max(_pct(lat[c], 0.99) for c in CALLS),
    }


# -- servers -----------------------------------------------------------------------------------


def start_metaserver(store: str, server_cpu: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdgate.metaserver", "--port", str(port), "--store", store, "--log-level", "warning"]
    if server_cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(server_cpu), *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    return proc, port


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def redis_ceiling(port: int, cpus: list[int] | None) -> dict[str, float]:
    """redis-benchmark on the same redis-server: requests/s of plain commands at 32 connections."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    cmd = [exe, "-p", str(port), "-q", "--csv", "-n", "200000", "-c", "32", "-t", "ping,set,get,incr"]
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    result = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] != "test":
            try:
                result[cells[0]] = float(cells[1])
            except ValueError:
                pass
    return result


# -- report ------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'store':<7} {'mode':<7} {'conc':>5} {'items/req':>9} {'handoffs/s':>11} {'errors':>6} "
        f"{'srv cpu ms/h':>12} {'1-core cap/s':>12} " + " ".join(f"{c + ' p50/p99 ms':>20}" for c in CALLS)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{r['calls'][c]['p50_ms']:>9.2f} /{r['calls'][c]['p99_ms']:>8.2f}" for c in CALLS)
        cpu = r["cpu_ms_per_handoff"].get("metaserver", float("nan"))
        cap = 1000.0 / cpu if cpu and cpu == cpu else float("nan")
        per = r.get("items_per_batch")
        lines.append(
            f"{r['store']:<7} {r.get('mode', 'single'):<7} {r['concurrency']:>5} {per or 1:>9.1f} "
            f"{r['handoffs_per_s']:>11.0f} {r['errors']:>6} {cpu:>12.3f} {cap:>12.0f} {cells}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--stores", nargs="+", default=["memory", "redis"], choices=["memory", "redis"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batch-in-flight", type=int, default=BATCH_IN_FLIGHT, help="batched: requests out per process")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "metaserver.json")
    args = ap.parse_args(argv)
    os.environ["PDGATE_BENCH_BATCH_IN_FLIGHT"] = str(args.batch_in_flight)  # read by the spawned clients

    ncpu = os.cpu_count() or 1
    server_cpu = 0 if ncpu > 1 else None
    client_cpus = list(range(1, ncpu)) if ncpu > 1 else None
    rows: list[dict[str, Any]] = []
    ceiling: dict[str, float] = {}
    with RedisServer() as redis:
        if client_cpus and shutil.which("taskset"):
            subprocess.run(["taskset", "-pc", ",".join(map(str, client_cpus)), str(redis.pid)], capture_output=True)
        for store in args.stores:
            url = "memory://" if store == "memory" else f"{redis.url}?prefix=bench"
            proc, port = start_metaserver(url, server_cpu)
            try:
                for mode in args.modes:
                    for c in args.concurrency:
                        watch = {"metaserver": proc.pid}
                        if store == "redis" and redis.pid is not None:
                            watch["redis"] = redis.pid
                        row = load(port, c, args.duration, args.warmup, client_cpus, watch, mode)
                        row["store"] = store
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
            finally:
                stop(proc)
        ceiling = redis_ceiling(redis.port, client_cpus)

    print()
    print(table(rows))
    if ceiling:
        print(
            "\nredis-benchmark ceiling (same redis-server, 32 connections, requests/s): "
            + ", ".join(f"{k} {v:,.0f}" for k, v in ceiling.items())
        )
    report = {
        "benchmark": "metaserver full handoff (create -> ready -> claim -> done) over HTTP, single calls and batched",
        "machine": {"cpus": ncpu, "python": platform.python_version(), "platform": platform.platform()},
        "pinning": {"metaserver_cpu": server_cpu, "clients_and_redis_cpus": client_cpus},
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "target": {"handoffs_per_s_redis_one_core": 2000, "p99_ms_at_32": 5.0},
        "runs": rows,
        "redis_benchmark_rps": ceiling,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""NIXL transport throughput: 4,096 scattered 64 KiB blocks pulled between two processes.

The prefill side is this script re-run with ``--serve`` in a subprocess; it fills a 256 MiB
buffer with seeded random bytes, registers it with ``NixlTransport`` and keeps polling. The
decode side (this process) pulls every block with src/dst ids drawn as two independent random
permutations, so nothing can be merged: the worst case for a paged KV cache.

In every repetition, just before the pull, the decode process copies exactly the same bytes
with a per-block numpy loop (the "memcpy" ceiling), so the ratio compares like with like
under whatever else the machine is doing. A contiguous pull (ids 0..n-1 on both sides, one
``np.copyto`` as its ceiling) is reported as a second row. Every pull is verified byte for
byte. The first pull (connection setup) is reported apart and left out of the medians.

    python bench/transfer.py [--blocks 4096] [--block-kib 64] [--reps 7] [--out bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pdgate.connector.transport.base import KVRegion, PullRequest, PullResult  # noqa: E402
from pdgate.connector.transport.nixl import NixlTransport  # noqa: E402

PREFIX = "PDGATE-BENCH "


def fill(num_blocks: int, block_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=num_blocks * block_len, dtype=np.uint8)


# ---------------------------------------------------------------- prefill side


def serve(args: argparse.Namespace) -> None:
    buf = fill(args.blocks, args.block_len, args.seed)
    transport = NixlTransport(agent_name=f"bench-prefill-{os.getpid()}", ucx_net_devices=args.ucx_net_devices)
    transport.register([KVRegion.dense("kv", buf.ctypes.data, args.block_len, args.blocks)])
    print(PREFIX + json.dumps(transport.local_address()), flush=True)
    stop = threading.Event()

    def wait_for_eof() -> None:  # the parent closes our stdin to stop us
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.is_set():
        transport.poll()  # the prefill side must make progress (and drains notifications)
        transport.drain_served()
        time.sleep(0.0005)
    transport.close()


# ---------------------------------------------------------------- decode side


def pull(transport: NixlTransport, req: PullRequest, timeout_s: float) -> tuple[PullResult, float]:
    t0 = time.perf_counter()
    transport.start_pull(req)
    deadline = t0 + timeout_s
    while time.perf_counter() < deadline:
        results = transport.poll()
        if results:
            return results[0], time.perf_counter() - t0
    raise RuntimeError(f"pull {req.transfer_id} gave no result within {timeout_s}s")


def memcpy_blocks(dst: np.ndarray, src: np.ndarray, dst_ids: np.ndarray, src_ids: np.ndarray) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        dst[d] = src[s]
    return time.perf_counter() - t0


def memcpy_contiguous(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, bl = args.blocks, args.block_len
    total = n * bl
    env = dict(os.environ, UCX_NET_DEVICES=args.ucx_net_devices, PYTHONPATH=str(REPO))
    cmd = [sys.executable, __file__, "--serve", "--blocks", str(n), "--block-len", str(bl), "--seed", str(args.seed)]
    peer = subprocess.Popen(
        [*cmd, "--ucx-net-devices", args.ucx_net_devices],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None
        address = None
        for line in peer.stdout:
            if line.startswith(PREFIX):
                address = json.loads(line[len(PREFIX) :])
                break
        if address is None:
            raise RuntimeError("prefill peer exited before publishing its address")
        return measure(args, address, n, bl, total)
    finally:
        if peer.stdin:
            peer.stdin.close()
        try:
            peer.wait(timeout=20)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()


def measure(args: argparse.Namespace, address: dict[str, Any], n: int, bl: int, total: int) -> dict[str, Any]:
    source = fill(n, bl, args.seed).reshape(n, bl)  # same bytes as the prefill, for memcpy and checks
    target = np.zeros(n * bl, dtype=np.uint8)
    scratch = np.zeros((n, bl), dtype=np.uint8)
    view = target.reshape(n, bl)
    transport = NixlTransport(ucx_net_devices=args.ucx_net_devices, pull_timeout_s=args.timeout_s)
    transport.register([KVRegion.dense("kv", target.ctypes.data, bl, n)])
    rng = np.random.default_rng(args.seed + 1)
    rows: dict[str, list[dict[str, float]]] = {"scattered": [], "contiguous": []}
    first: dict[str, float] = {}
    try:
        for rep in range(args.reps + 1):
            for case in ("scattered", "contiguous"):
                if case == "scattered":
                    src, dst = rng.permutation(n), rng.permutation(n)
                    mem_s = memcpy_blocks(scratch, source, dst, src)
                else:
                    src = dst = np.arange(n)
                    mem_s = memcpy_contiguous(scratch, source)
                target.fill(0)
                req = PullRequest(f"{case}-{rep}", rep, address, src.tolist(), dst.tolist())
                res, pull_s = pull(transport, req, args.timeout_s)
                if not res.ok:
                    raise RuntimeError(f"pull {req.transfer_id} failed: {res.error}")
                if not np.array_equal(view[dst], source[src]):
                    raise RuntimeError(f"pull {req.transfer_id}: bytes differ from the prefill's")
                sample = {"nixl_s": pull_s, "memcpy_s": mem_s}
                if rep == 0:
                    first[case] = pull_s
                else:
                    rows[case].append(sample)
    finally:
        transport.close()
    return summarise(args, rows, first, n, total)


def summarise(
    args: argparse.Namespace, rows: dict[str, list[dict[str, float]]], first: dict[str, float], n: int, total: int
) -> dict[str, Any]:
    cases = {}
    for case, samples in rows.items():
        nixl_s = statistics.median(s["nixl_s"] for s in samples)
        mem_s = statistics.median(s["memcpy_s"] for s in samples)
        ratios = [s["memcpy_s"] / s["nixl_s"] for s in samples]
        cases[case] = {
            "nixl_gbps": total / nixl_s / 1e9,
            "nixl_blocks_per_s": n / nixl_s,
            "memcpy_gbps": total / mem_s / 1e9,
            "memcpy_blocks_per_s": n / mem_s,
            "ratio_median": statistics.median(ratios),
            "first_pull_s": first[case],
            "samples": samples,
        }
    return {
        "config": {
            "blocks": n,
            "block_len": args.block_len,
            "bytes": total,
            "reps": args.reps,
            "seed": args.seed,
            "UCX_NET_DEVICES": args.ucx_net_devices,
            "UCX_TLS": os.environ.get("UCX_TLS"),
        },
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "nixl": _version("nixl"),
            "numpy": np.__version__,
        },
        "cases": cases,
        "verified": True,
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"NIXL pull, {cfg['blocks']} x {cfg['block_len'] // 1024} KiB = {cfg['bytes'] / 2**20:.0f} MiB, "
        f"median of {cfg['reps']} reps (GB/s = 1e9 B/s), UCX_NET_DEVICES={cfg['UCX_NET_DEVICES']}, "
        f"load {result['host']['loadavg'][0]:.2f} on {result['host']['cpus']} CPUs"
    )
    print("| case       | NIXL GB/s | NIXL blocks/s | memcpy GB/s | memcpy blocks/s | NIXL / memcpy | first pull |")
    print("|------------|-----------|---------------|-------------|-----------------|---------------|------------|")
    for case, c in result["cases"].items():
        print(
            f"| {case:10} | {c['nixl_gbps']:9.2f} | {c['nixl_blocks_per_s']:13,.0f} | {c['memcpy_gbps']:11.2f} "
            f"| {c['memcpy_blocks_per_s']:15,.0f} | {c['ratio_median'] * 100:12.0f}% "
            f"| {c['first_pull_s'] * 1e3:7.1f} ms |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--block-len", type=int, default=None, help=argparse.SUPPRESS)  # bytes; used by --serve
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--ucx-net-devices", default="lo", help="UCX_NET_DEVICES for both processes (default lo)")
    ap.add_argument("--out", default="bench/results/transfer.json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.block_len is None:
        args.block_len = args.block_kib * 1024
    if args.serve:
        serve(args)
        return
    result = run(args)
    print_table(result)
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

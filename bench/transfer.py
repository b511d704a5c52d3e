"""Every KV transport side by side, against memcpy and a plain loopback socket: GB/s and per-call latency.

For each transport the prefill side is this script re-run with ``--serve KIND`` in a subprocess: it fills
a buffer with seeded random bytes, registers it and keeps polling (or, for ``socket``, answers range
requests on a TCP connection). The decode side (this process) then, per transport:

* pulls ``--blocks`` blocks of ``--block-kib`` KiB with source and destination ids drawn as two
  independent random permutations, so nothing merges: the worst case for a paged KV cache. The first pull
  (connection setup) is reported apart; the median of ``--reps`` more is the GB/s. Every pull is checked
  byte for byte against the prefill's bytes.
* pulls ONE block ``--calls`` times: the per-call latency (p50, p99), setup and polling included.

``memcpy`` is the same copy done by a per-block numpy loop in this process (the ceiling); ``socket`` is
the 30-line baseline: one TCP connection, a request of (offset, length) pairs, ``recv_into`` straight into
each destination block. Transports: ``nixl`` (UCX picks same-host CMA: shared memory, no network),
``nixl-tcp`` (``UCX_TLS=tcp``, the network path), ``mooncake`` (protocol tcp). llm_datadist needs an
Ascend NPU and CANN, so it is listed and not measured. A transport whose package is missing is reported
as such and the rest still run.

    python bench/transfer.py [--blocks 1024] [--block-kib 64] [--reps 5] [--calls 300]
                             [--only nixl,mooncake] [--out bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import struct
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

from pdgate.connector.transport import transport_class  # noqa: E402
from pdgate.connector.transport.base import KVRegion, PullRequest, Transport  # noqa: E402

PREFIX = "PDGATE-BENCH "
# name -> (transport kind, package that must be installed, environment for both processes, options)
TRANSPORTS: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "nixl": ("nixl", "nixl", {"UCX_NET_DEVICES": "lo"}, {}),
    "nixl-tcp": ("nixl", "nixl", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}, {}),
    "mooncake": ("mooncake", "mooncake", {"GLOG_minloglevel": "1"}, {"hostname": "127.0.0.1", "protocol": "tcp"}),
}
NOT_HERE = {"llmdatadist": "needs an Ascend NPU and CANN's llm_datadist; the tests use a fake"}


def fill(num_blocks: int, block_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=num_blocks * block_len, dtype=np.uint8)


# ---------------------------------------------------------------- prefill side


def serve(args: argparse.Namespace) -> None:
    buf = fill(args.blocks, args.block_len, args.seed)
    stop = threading.Event()

    def wait_for_eof() -> None:  # the parent closes our stdin to stop us
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    if args.serve == "socket":
        serve_socket(buf, stop)
        return
    kind, _, _, options = TRANSPORTS[args.serve]
    transport = transport_class(kind)(**options)
    transport.register([KVRegion.dense("kv", buf.ctypes.data, args.block_len, args.blocks)])
    print(PREFIX + json.dumps(transport.local_address()), flush=True)
    while not stop.is_set():
        transport.poll()  # the prefill side must make progress (and drains notifications)
        transport.drain_served()
        time.sleep(args.serve_poll_s)
    transport.close()


def serve_socket(buf: np.ndarray, stop: threading.Event) -> None:
    """Request: u32 n, then n x (u64 offset, u64 length). Answer: the ranges back to back, no copy."""
    view = buf.data  # a memoryview of the buffer: sendall slices it without a copy
    lsock = socket.create_server(("127.0.0.1", 0))
    print(PREFIX + json.dumps({"port": lsock.getsockname()[1]}), flush=True)
    lsock.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = lsock.accept()
        except TimeoutError:
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = _recv_exact(conn, 4)
                if head is None:
                    break
                (n,) = struct.unpack("<I", head)
                body = _recv_exact(conn, 16 * n)
                if body is None:
                    break
                for off, length in struct.iter_unpack("<QQ", body):
                    conn.sendall(view[off : off + length])


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


# ---------------------------------------------------------------- decode side


class SocketPuller:
    """The baseline client: one connection, ranges requested in one message, received in place."""

    def __init__(self, port: int, block_len: int, dst: np.ndarray) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bl = block_len
        self.dst = dst.data

    def pull(self, src: list[int], dst: list[int]) -> None:
        req = struct.pack("<I", len(src)) + b"".join(struct.pack("<QQ", s * self.bl, self.bl) for s in src)
        self.sock.sendall(req)
        for d in dst:
            target = self.dst[d * self.bl : (d + 1) * self.bl]
            got = 0
            while got < self.bl:
                n = self.sock.recv_into(target[got:], self.bl - got)
                if n == 0:
                    raise RuntimeError("socket peer closed")
                got += n

    def close(self) -> None:
        self.sock.close()


def pull(transport: Transport, req: PullRequest, timeout_s: float) -> float:
    t0 = time.perf_counter()
    transport.start_pull(req)
    deadline = t0 + timeout_s
    while time.perf_counter() < deadline:
        results = transport.poll()
        if results:
            if not results[0].ok:
                raise RuntimeError(f"pull {req.transfer_id} failed: {results[0].error}")
            return time.perf_counter() - t0
        time.sleep(0)  # yield the GIL: an engine's own thread (Mooncake's worker) delivers the result
    raise RuntimeError(f"pull {req.transfer_id} gave no result within {timeout_s}s")


def start_peer(args: argparse.Namespace, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], Any]:
    cmd = [sys.executable, __file__, "--serve", name, "--blocks", str(args.blocks)]
    cmd += ["--block-len", str(args.block_len), "--seed", str(args.seed), "--serve-poll-s", str(args.serve_poll_s)]
    peer = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert peer.stdout is not None
    for line in peer.stdout:
        if line.startswith(PREFIX):
            return peer, json.loads(line[len(PREFIX) :])
    peer.wait(timeout=10)
    raise RuntimeError(f"{name} peer exited with {peer.returncode} before publishing its address")


def stop_peer(peer: subprocess.Popen[str]) -> None:
    if peer.stdin:
        peer.stdin.close()
    try:
        peer.wait(timeout=20)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait()


def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One transport (or the socket baseline) in its own peer process: GB/s and per-call latency."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    options: dict[str, Any] = {}
    if name != "socket":
        _, _, extra_env, options = TRANSPORTS[name]
        env.update(extra_env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the decode side reads the same settings (UCX_TLS, ...)
    peer, address = start_peer(args, name, env)
    try:
        return _pulls(args, name, address, options)
    finally:
        stop_peer(peer)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pulls(args: argparse.Namespace, name: str, address: Any, options: dict[str, Any]) -> dict[str, Any]:
    n, bl = args.blocks, args.block_len
    source = fill(n, bl, args.seed).reshape(n, bl)
    target = np.zeros(n * bl, dtype=np.uint8)
    view = target.reshape(n, bl)
    transport: Transport | None = None
    puller: SocketPuller | None = None
    if name == "socket":
        puller = SocketPuller(address["port"], bl, target)
    else:
        cls: Any = transport_class(TRANSPORTS[name][0])  # each engine takes its own keyword arguments
        transport = cls(pull_timeout_s=args.timeout_s, **options)
        transport.register([KVRegion.dense("kv", target.ctypes.data, bl, n)])
    counter = iter(range(10**9))

    def one(src: list[int], dst: list[int]) -> float:
        if puller is not None:
            t0 = time.perf_counter()
            puller.pull(src, dst)
            return time.perf_counter() - t0
        assert transport is not None
        i = next(counter)
        return pull(transport, PullRequest(f"{name}-{i}", i, address, src, dst), args.timeout_s)

    rng = np.random.default_rng(args.seed + 1)
    try:
        times = []
        for _ in range(args.reps + 1):
            src, dst = rng.permutation(n), rng.permutation(n)
            target.fill(0)
            times.append(one(src.tolist(), dst.tolist()))
            if not np.array_equal(view[dst], source[src]):
                raise RuntimeError(f"{name}: pulled bytes differ from the prefill's")
        calls = [one([int(rng.integers(n))], [0]) for _ in range(args.calls)]
    finally:
        if transport is not None:
            transport.close()
        if puller is not None:
            puller.close()
    return _row(n * bl, times[0], times[1:], calls)


def measure_memcpy(args: argparse.Namespace) -> dict[str, Any]:
    n, bl = args.blocks, args.block_len
    source = fill(n, bl, args.seed).reshape(n, bl)
    dst = np.zeros((n, bl), dtype=np.uint8)
    rng = np.random.default_rng(args.seed + 1)
    times = []
    for _ in range(args.reps + 1):
        src_ids, dst_ids = rng.permutation(n).tolist(), rng.permutation(n).tolist()
        t0 = time.perf_counter()
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[d] = source[s]
        times.append(time.perf_counter() - t0)
    calls = []
    for _ in range(args.calls):
        s = int(rng.integers(n))
        t0 = time.perf_counter()
        dst[0] = source[s]
        calls.append(time.perf_counter() - t0)
    return _row(n * bl, times[0], times[1:], calls)


def _row(total: int, first_s: float, times: list[float], calls: list[float]) -> dict[str, Any]:
    calls_sorted = sorted(calls)
    return {
        "gbps": total / statistics.median(times) / 1e9,
        "gbps_best": total / min(times) / 1e9,
        "first_pull_s": first_s,
        "call_p50_us": statistics.median(calls) * 1e6,
        "call_p99_us": calls_sorted[min(len(calls) - 1, int(0.99 * len(calls)))] * 1e6,
    }


# ---------------------------------------------------------------- report


def run(args: argparse.Namespace) -> dict[str, Any]:
    wanted = args.only.split(",") if args.only else ["memcpy", "socket", *TRANSPORTS]
    rows: dict[str, Any] = {}
    for name in wanted:
        if name == "memcpy":
            rows[name] = measure_memcpy(args)
        elif name == "socket":
            rows[name] = measure(args, name)
        elif importlib.util.find_spec(TRANSPORTS[name][1]) is None:
            rows[name] = {"skipped": f"package {TRANSPORTS[name][1]!r} is not installed"}
        else:
            rows[name] = measure(args, name)
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    for name, why in NOT_HERE.items():
        rows[name] = {"skipped": why}
    return {
        "config": {"blocks": args.blocks, "block_len": args.block_len, "reps": args.reps, "calls": args.calls},
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "versions": {d: _version(d) for d in ("nixl", "mooncake-transfer-engine-non-cuda", "numpy")},
        },
        "rows": rows,
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
        f"{cfg['blocks']} scattered blocks x {cfg['block_len'] // 1024} KiB = "
        f"{cfg['blocks'] * cfg['block_len'] / 2**20:.0f} MiB per pull, median of {cfg['reps']} pulls "
        f"(GB/s = 1e9 B/s); one-block call latency over {cfg['calls']} calls; "
        f"load {result['host']['loadavg'][0]:.2f} on {result['host']['cpus']} CPUs"
    )
    print("| path | GB/s (median) | GB/s (best) | first pull | one-block call p50 | p99 |")
    print("|---|---|---|---|---|---|")
    for name, r in result["rows"].items():
        if "skipped" in r:
            print(f"| {name} | - | - | - | - | not run: {r['skipped']} |")
            continue
        print(
            f"| {name} | {r['gbps']:.2f} | {r['gbps_best']:.2f} | {r['first_pull_s'] * 1e3:.1f} ms "
            f"| {r['call_p50_us']:.1f} us | {r['call_p99_us']:.1f} us |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--block-len", type=int, default=None, help=argparse.SUPPRESS)  # bytes; used by --serve
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--only", default=None, help="comma-separated: memcpy,socket,nixl,nixl-tcp,mooncake")
    ap.add_argument("--out", default="bench/results/transfer.json")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--serve-poll-s",
        type=float,
        default=0.0005,
        help="the prefill's poll interval (default 0.5 ms: the connector's while it holds KV)",
    )
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

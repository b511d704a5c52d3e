"""Micro-benchmark: the router's upstream client (`HttpPool`) CPU per request against a canned HTTP server,
for the read-timeout bookkeeping of `Http1Connection.wait` (one loop timer per wait, or one per connection).

The server (a separate process, pinned away from the client when there are 2+ CPUs) answers every request
either at once in one write (`plain`: the client waits once, for the head) or as 32 chunks written 0.2 ms
apart (`chunks`: the client waits once per chunk, like a streamed completion). The figure is the client
process's CPU time (`time.process_time`) per request over `-n` requests at concurrency `-c`, best of
`--rounds`. Run it from the tree to measure; `PYTHONPATH=DIR` measures another (DIR/pdgate/...):

    .venv-vllm/bin/python bench/router_waits.py --label after
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import uvloop

from pdgate.http_pool import HttpPool

SERVER = r"""
import asyncio, sys, uvloop
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n"
CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
class P(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, data):
        for _ in range(data.count(b"\r\n\r\n")):
            if b"/chunks" in data: asyncio.ensure_future(self.chunks())
            else: self.t.write(HEAD % 16 + b"x" * 16)
    async def chunks(self):
        self.t.write(CHUNKED)
        for _ in range(32):
            await asyncio.sleep(0.0002)
            self.t.write(b"10\r\n" + b"y" * 16 + b"\r\n")
        self.t.write(b"0\r\n\r\n")
async def main():
    srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await srv.serve_forever()
uvloop.run(main())
"""


async def run(url: str, n: int, conc: int) -> float:
    """Client CPU seconds for `n` requests to `url`, `conc` at a time."""
    pool = HttpPool()
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            resp = await pool.request("GET", url, [], b"", timeout=30.0)
            await resp.read(timeout=30.0)

    await asyncio.gather(*(worker() for _ in range(conc)))  # warm the connections
    left = n
    c0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(conc)))
    cpu = time.process_time() - c0
    await pool.aclose()
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="current")
    ap.add_argument("-n", type=int, default=5000)
    ap.add_argument("-c", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = 20000 + os.getpid() % 20000
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == b"ready"
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(srv.pid, {1})
            os.sched_setaffinity(0, {0})
        for what in ("plain", "chunks"):
            url = f"http://127.0.0.1:{port}/{what}"
            n = args.n if what == "plain" else args.n // 8
            best = min(uvloop.run(run(url, n, args.c)) for _ in range(args.rounds))
            print(f"{args.label:<8} {what:<7} c={args.c}  {best / n * 1e6:7.2f} us CPU/request")
    finally:
        srv.kill()


if __name__ == "__main__":
    main()

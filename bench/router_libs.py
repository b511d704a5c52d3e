"""bench/router.py --libs: CPU per request of candidate HTTP clients and ASGI stacks, and per JSON op.

Why the router has its own HTTP client (`pdgate.http_pool`) and serves raw ASGI on its hot path:
these numbers, measured on the machine at hand.
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import orjson

from bench.router_procs import PY, Procs, tree_cpu_seconds
from bench.router_scripts import READ_BODY
from tests.support.ports import free_port
from tests.support.servers import wait_http

__all__ = ["SERVER_KINDS", "measure_libs", "server_cpu"]

# raw ASGI under uvicorn's protocol; under the router's protocol without and with the fast lane; frameworks
SERVER_KINDS = ("raw", "guarded", "lane", "starlette", "fastapi")


LIB_SERVER = (
    READ_BODY
    + """
import sys, orjson
BODY = orjson.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
                     "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]]}})
kind, port = sys.argv[1], int(sys.argv[2])
async def raw(scope, receive, send):
    body = await read_body(scope, receive, send)
    if body is None:
        return
    orjson.loads(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
app = raw
if kind == "starlette":
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route
    async def h(request):
        orjson.loads(await request.body()); return Response(BODY, media_type="application/json")
    app = Starlette(routes=[Route("/v1/completions", h, methods=["POST"])])
elif kind == "fastapi":
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    app = FastAPI()
    @app.post("/v1/completions")
    async def h(request: Request):
        orjson.loads(await request.body()); return Response(BODY, media_type="application/json")
http = "auto"
if kind in ("guarded", "lane"):  # the router's own protocol, without and with its fast lane (router/fastlane.py)
    from pdgate.router.app import serving_protocol
    from pdgate.router.settings import RouterSettings
    http = serving_protocol(RouterSettings(), fast_lane=kind == "lane")
import uvicorn
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http=http)
"""
)


async def client_cpu(kind: str, url: str, n: int, conc: int) -> float:
    body = orjson.dumps({"model": "m", "prompt": "hello world " * 20, "max_tokens": 16})
    hdrs = {"content-type": "application/json"}
    if kind == "httpx":
        import httpx

        c = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))

        async def one() -> None:
            orjson.loads((await c.post(url, content=body, headers=hdrs)).content)

        close: Any = c.aclose
    elif kind == "aiohttp":
        import aiohttp

        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))

        async def one() -> None:
            async with s.post(url, data=body, headers=hdrs) as r:
                orjson.loads(await r.read())

        close = s.close
    else:
        from pdgate.http_pool import HttpPool

        pool = HttpPool()
        h = [(b"content-type", b"application/json")]

        async def one() -> None:
            r = await pool.request("POST", url, h, body)
            orjson.loads(await r.read())

        close = pool.aclose
    sem = asyncio.Semaphore(conc)

    async def task() -> None:
        async with sem:
            await one()

    for _ in range(100):
        await one()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(task() for _ in range(n)))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    await close()
    return ((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)) / n * 1e6


def json_costs() -> dict[str, float]:
    import json as std

    doc = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello world " * 200}],
        "max_tokens": 64,
        "kv_transfer_params": {"remote_block_ids": [list(range(64))], "remote_engine_id": "e"},
    }
    raw = orjson.dumps(doc)
    out = {}
    for name, dumps, loads in (
        ("orjson", orjson.dumps, orjson.loads),
        ("json", lambda o: std.dumps(o).encode(), std.loads),
    ):
        t = time.process_time()
        for _ in range(5000):
            loads(raw)
            dumps(doc)
        out[name] = (time.process_time() - t) / 5000 * 1e6
    return out


def server_cpu(procs: Procs, kind: str, n: int = 4000) -> float:
    """The server process's CPU per request (one of SERVER_KINDS) under the native client at c=32."""
    import uvloop

    port = free_port()
    proc = procs.start(f"lib-{kind}", [PY, "-c", LIB_SERVER, kind, str(port)], "0")
    surl = f"http://127.0.0.1:{port}/v1/completions"
    wait_http(surl, timeout=20, status=None)
    uvloop.run(client_cpu("native", surl, 300, 32))
    c0 = tree_cpu_seconds(proc.pid)
    uvloop.run(client_cpu("native", surl, n, 32))
    return (tree_cpu_seconds(proc.pid) - c0) / (n + 100) * 1e6  # client_cpu's 100 warm-up requests too


def measure_libs() -> dict[str, Any]:
    import uvloop

    print("\n== libraries (CPU per request/op, concurrency 32) ==")
    results: dict[str, Any] = {"client_us": {}, "server_us": {}, "json_us": json_costs()}
    procs = Procs()
    try:
        port = free_port()
        procs.start("lib-raw", [PY, "-c", LIB_SERVER, "raw", str(port)], "0")
        wait_http(f"http://127.0.0.1:{port}/v1/completions", timeout=20, status=None)
        url = f"http://127.0.0.1:{port}/v1/completions"
        kinds = ["httpx", "native"]
        try:
            import aiohttp  # noqa: F401

            kinds.insert(1, "aiohttp")
        except ImportError:
            print("(aiohttp not installed: skipped)")
        for kind in kinds:
            us = uvloop.run(client_cpu(kind, url, 1000 if kind == "httpx" else 4000, 32))
            results["client_us"][kind] = us
            print(f"client {kind:<8} {us:8.0f} us/request")
        for kind in SERVER_KINDS:
            us = server_cpu(procs, kind)
            results["server_us"][kind] = us
            print(f"server {kind:<9} {us:8.0f} us/request (uvicorn + uvloop + httptools)")
        for name, us in results["json_us"].items():
            print(f"json   {name:<9} {us:8.1f} us per loads+dumps of a 2.6 kB chat body")
    finally:
        procs.stop()
    return results

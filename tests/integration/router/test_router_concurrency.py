"""1,024 concurrent streaming clients through one router process (the pdgate-router CLI): zero errors.

The prefill simulators hold every request until 512 are in flight at each, so the router provably
carries all 1,024 at once (round robin splits them evenly). No timing is asserted.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from tests.integration.router.conftest import _LOGS, Sim, start_sims
from tests.support.ports import free_port
from tests.support.servers import wait_http

N = 1024


@pytest.fixture(scope="module")
def router(fd_limit: None) -> Iterator[tuple[str, list[Sim]]]:
    sims = start_sims([("prefill", ()), ("prefill", ()), ("decode", ()), ("decode", ())])
    port = free_port()
    cmd = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    cmd += ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    for s in sims:
        cmd += [f"--{s.role}", s.url]
    log = (_LOGS / f"router-{port}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=30)
        yield url, sims
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()
        for s in sims:
            s.stop()


async def run_streams(url: str) -> list[str]:
    try:  # openai 3.x runs on httpx2, older releases on httpx: raise the pool limit of whichever it uses
        import httpx2 as hx

        factory = openai.DefaultAsyncHttpx2Client
    except (ImportError, AttributeError):
        import httpx as hx  # type: ignore[no-redef]

        factory = openai.DefaultAsyncHttpxClient  # type: ignore[assignment]
    limits = hx.Limits(max_connections=N + 64, max_keepalive_connections=N + 64)
    http = factory(limits=limits, timeout=120)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)

    async def one(i: int) -> str:
        stream = await client.completions.create(model="sim-model", prompt=f"client {i}", max_tokens=16, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    try:
        results = await asyncio.gather(*(one(i) for i in range(N)), return_exceptions=True)
    finally:
        await client.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], f"{len(errors)} errors, first: {errors[0]!r}"
    return [r for r in results if isinstance(r, str)]


def test_1024_concurrent_streams_without_an_error(router: tuple[str, list[Sim]]) -> None:
    url, sims = router
    prefills = [s for s in sims if s.role == "prefill"]
    for p in prefills:
        p.script(hold_until=N // len(prefills))
    texts = asyncio.run(run_streams(url))
    assert len(texts) == N and all(len(t.split()) == 16 for t in texts)
    assert [p.stats()["max_inflight"] for p in prefills] == [N // 2, N // 2]
    decodes = [s for s in sims if s.role == "decode"]
    assert sum(d.count("streams_completed") for d in decodes) == N
    assert sum(s.count("mismatches") for s in sims) == 0
    assert sum(d.count("claimed") for d in decodes) == N

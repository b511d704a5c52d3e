"""`pdgate-router --workers N` (issue 12): N processes on one port, one ledger, a dead engine leaves every one.

Real parts: the `pdgate-router` CLI as users start it (its own process, forking its workers), a real
`redis-server` for the embedded metaserver's store, `pdgate-sim` engines that register with the router
and record every handoff in the ledger, and the official `openai` client on fresh connections, so that
the kernel spreads the requests over the workers (SO_REUSEPORT).

Retries are off: a request that a worker sends to the dead decode fails instead of being retried on the
other one, so "every request succeeds" means "no worker routes to it any more".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pdgate.router.settings import RouterSettings
from pdgate.router.workers import shared_store, workers_problem

from tests.integration.router.conftest import Sim, start_sims
from tests.support.ports import free_port
from tests.support.redis import RedisServer
from tests.support.servers import wait_http

HEALTH_S = 0.5
HEALTH_TIMEOUT_S = 0.5


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with RedisServer() as redis:
        port = free_port()
        cmd = [sys.executable, "-m", "pdgate.router", "--workers", "2", "--port", str(port), "--store", redis.url]
        cmd += ["--health-interval-s", str(HEALTH_S), "--health-timeout-s", str(HEALTH_TIMEOUT_S)]
        cmd += ["--refresh-interval-s", "0.2", "--decode-retries", "0", "--prefill-retries", "0"]
        cmd += ["--log-level", "warning"]
        log = (tmp_path / "router.log").open("wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", status=None, timeout=30)
            yield f"http://127.0.0.1:{port}", proc
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            log.close()


def _send(url: str, n: int) -> list[str]:
    """n completions, each on a new connection; the error code of each failure."""
    failures = []
    for i in range(n):
        with httpx.Client(timeout=20) as http:  # a fresh connection per request: the kernel picks the worker
            client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, http_client=http)
            try:
                out = client.completions.create(model="sim-model", prompt=f"w{i}", max_tokens=2)
                assert out.choices[0].text
            except openai.APIStatusError as exc:
                failures.append(str((exc.body or {}).get("code") if isinstance(exc.body, dict) else exc.status_code))
    return failures


def _wait_every_worker(url: str, ok: Callable[[frozenset[str]], bool], what: str, timeout: float = 30) -> None:
    """Until `ok(available instance ids)` holds for every worker that answers /health (deadline: `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = set()
        for _ in range(8):  # several connections: every worker must agree
            with httpx.Client(timeout=5) as http:
                body = http.get(url + "/health").json()
            seen.add(frozenset(i["id"] for i in body["instances"] if i["available"]))
        if all(ok(s) for s in seen):
            return
        time.sleep(0.2)
    raise TimeoutError(f"not every worker {what}")


def _wait_registered(url: str, sims: list[Sim]) -> None:
    want = {s.id for s in sims}
    _wait_every_worker(url, lambda available: want <= available, f"lists {want}")


def test_workers_share_one_ledger_and_all_drop_a_dead_decode(router: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = router
    assert len(_children(proc.pid)) == 2  # the parent forked two workers and serves nothing itself
    sims = start_sims([("prefill", ()), ("decode", ()), ("decode", ())], metaserver=url)
    try:
        _, d0, d1 = sims
        _wait_registered(url, sims)
        # A handoff recorded by one worker is claimed by the decode through whichever worker its own
        # connection reaches: with one ledger per worker, about half of these would fail.
        assert _send(url, 24) == []
        assert d0.count("claimed") > 0 and d1.count("claimed") > 0

        d1.stop(signal.SIGKILL)
        # Every worker's health round takes it out of rotation (at most HEALTH_S + HEALTH_TIMEOUT_S each).
        _wait_every_worker(url, lambda available: d1.id not in available, f"dropped {d1.id}")
        assert _send(url, 40) == []  # no worker sends a request to the dead decode
    finally:
        for s in sims:
            s.stop()
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    for pid in children:  # the workers went with the parent
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_workers_without_a_shared_store_are_refused() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_")}
    done = subprocess.run(
        [sys.executable, "-m", "pdgate.router", "--workers", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--workers 2 needs one ledger" in done.stderr and "--store redis://" in done.stderr


@pytest.mark.parametrize(
    "store",
    [
        "redis://r:6379/0",
        "REDIS://r:6379/0",
        "rediss://r:6380/0",
        "unix:///run/redis.sock",
        "redis+sentinel://s1:26379,s2:26379/mymaster/0",
        "rediss+sentinel://s1:26379/mymaster",
        "redis+cluster://c1:7000,c2:7001/0",
        "Rediss+Cluster://c1:7000",
    ],
)
def test_workers_accept_every_shared_store(store: str) -> None:
    """Every store the metaserver opens on a server is one ledger for all workers (issue 21, finding 8)."""
    settings = RouterSettings(workers=4, store=store)
    assert shared_store(store) and workers_problem(settings) is None


@pytest.mark.parametrize("store", ["memory://", "MEMORY://", "nosuch://x"])
def test_workers_refuse_a_store_of_one_process(store: str) -> None:
    problem = workers_problem(RouterSettings(workers=2, store=store))
    assert problem is not None and "one ledger per worker" in problem
    assert workers_problem(RouterSettings(workers=1, store=store)) is None
    assert workers_problem(RouterSettings(workers=2, store=store, metaserver="http://m:8300")) is None

"""Fan-out is inside admission control (issue #21, finding 3).

Before, `--max-inflight` counted client requests, not the engine requests they cause: 256 prompts x n=128
was accepted with 200 while the router's in-flight gauge read 1 and the prefill had 253 requests in
flight, and the failures of that one burst opened the prefill's breaker, so every other client got
"unavailable". Now a request counts prompts x n against `--max-inflight`, one over `--max-fan-out` is
refused before any engine work, and failures of requests in flight together count once against a
breaker. A router with its embedded metaserver in front of pdgate-sim processes, over real sockets.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.router.conftest import Deployment, Sim
from tests.support.ports import wait_until

MAX_INFLIGHT = 8


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    # whole_on_failure off: the burst's failures must reach the breaker (router/whole.py serves them whole)
    with Deployment(max_inflight=MAX_INFLIGHT, prefill_timeout_s=10.0, breaker_failures=3, whole_on_failure=False) as d:
        d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> Iterator[None]:
    dep.reset_sims()
    yield
    dep.reset_sims()


def _complete(d: Deployment, prompts: int, n: int = 1) -> httpx.Response:
    body = {"model": "sim-model", "prompt": [f"prompt {i}" for i in range(prompts)], "n": n, "max_tokens": 2}
    return httpx.post(d.url + "/v1/completions", json=body, timeout=30)


def _engine_requests(d: Deployment) -> int:
    return sum(s.count("requests") for s in d.sims)


def _gauge(d: Deployment) -> float:
    found = re.search(r"^pdgate_router_inflight (\S+)$", httpx.get(d.url + "/metrics", timeout=5).text, re.M)
    assert found
    return float(found.group(1))


def _error(resp: httpx.Response) -> dict[str, Any]:
    return dict(resp.json()["error"])


def test_256_prompts_times_n_128_is_refused_before_any_engine_work() -> None:
    with Deployment() as d:  # the defaults, as shipped
        sims = d.add_many([("prefill", ()), ("decode", ())])
        d.wait_available(*(s.id for s in sims))
        before = _engine_requests(d)
        resp = _complete(d, 256, n=128)
        assert resp.status_code == 400, resp.text
        assert _error(resp)["code"] == "pd_unsupported_parameter" and _error(resp)["param"] == "n"
        assert _engine_requests(d) == before


def test_a_request_counts_prompts_times_n_against_max_inflight(dep: Deployment) -> None:
    over = _complete(dep, 3, n=3)  # 9 engine requests can never fit under 8
    assert over.status_code == 400 and _error(over)["code"] == "pd_unsupported_parameter"
    prefill = next(s for s in dep.sims if s.role == "prefill")
    prefill.script(prefill_delay=1.5)
    held: list[httpx.Response] = []
    first = threading.Thread(target=lambda: held.append(_complete(dep, 3, n=2)))  # 6 engine requests
    first.start()
    try:
        wait_until(lambda: prefill.stats()["inflight"][0] >= 3, timeout=10, what="the first request at the prefill")
        assert _gauge(dep) == 6
        refused = _complete(dep, 3)  # 6 + 3 > 8
        assert refused.status_code == 429, refused.text
        assert _error(refused)["code"] == "pd_overloaded" and refused.headers["retry-after"]
        prefill.script(prefill_delay=0.0)
        assert _complete(dep, 2).status_code == 200  # 6 + 2 fits
    finally:
        first.join(timeout=30)
    assert held and held[0].status_code == 200
    assert [c["index"] for c in held[0].json()["choices"]] == [0, 2, 4]  # pdgate-sim answers one of n
    assert _gauge(dep) == 0


def _prefill_breaker(d: Deployment, prefill: Sim) -> str:
    return str(next(i["breaker"] for i in d.health()["instances"] if i["id"] == prefill.id))


def test_one_clients_burst_of_failures_does_not_open_the_breaker(dep: Deployment) -> None:
    prefill = next(s for s in dep.sims if s.role == "prefill")
    prefill.script(prefill_delay=0.3, fail_first=MAX_INFLIGHT, fail_status=503)
    burst = _complete(dep, MAX_INFLIGHT)  # all in flight together, all failing together
    assert burst.status_code >= 500
    assert _prefill_breaker(dep, prefill) == "closed"
    prefill.script(prefill_delay=0.0, fail_first=0)  # the engine is well again: the breaker must not say otherwise
    other = _complete(dep, 1)  # another client is still served
    assert other.status_code == 200, other.text

"""Transfer ids cannot be guessed or squatted (issue 9): 128 random bits each, and a create that finds
its id taken is retried with a fresh one. Before, ids were a process prefix plus a counter: a client
read one id off its answer (X-Request-Id), pre-created the next five, and five real requests failed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.integration.router.conftest import Deployment
from tests.support.ports import wait_until


@pytest.fixture
def pd() -> Iterator[Deployment]:
    with Deployment() as d:
        d.add_many([("prefill", ()), ("decode", ())])
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="a PD pair")
        yield d


def _tid(d: Deployment, prompt: str) -> str:
    raw = d.openai().completions.with_raw_response.create(model="sim-model", prompt=prompt, max_tokens=1)
    assert raw.parse().choices
    return str(raw.headers["x-request-id"])


def _squat(d: Deployment, tid: str) -> int:
    prefill = next(i["id"] for i in d.health()["instances"] if i["role"] == "prefill")
    body = {"prefill_instance_id": prefill, "transfer_id": tid}
    return httpx.post(d.url + "/v1/handoffs", json=body, timeout=5).status_code


def test_predicted_ids_created_in_advance_do_not_fail_real_requests(pd: Deployment) -> None:
    seen = _tid(pd, "first")
    head, _, tail = seen.rpartition("-")
    guesses = [f"{head}-{int(tail, 16) + k:x}" for k in range(1, 11)]
    assert all(_squat(pd, g) == 201 for g in guesses)  # the attacker's creates all go through
    for i in range(10):
        assert _tid(pd, f"victim {i}") not in guesses


def test_ids_carry_at_least_122_random_bits(pd: Deployment) -> None:
    ids = [_tid(pd, f"p{i}") for i in range(12)]
    assert all(re.fullmatch(r"pd-[0-9a-f]{32}", t) for t in ids), ids
    shared = max(len(os.path.commonprefix([a[3:], b[3:]])) for a in ids for b in ids if a != b)  # noqa: RUF071
    assert shared < 6, f"two ids share {shared} leading hex digits: not random"


def test_a_create_that_hits_a_taken_id_retries_with_a_fresh_one(
    pd: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdgate.router.proxy as proxy_module

    taken = "pd-squatted-by-someone-else"
    assert _squat(pd, taken) == 201
    real: Callable[[], str] = proxy_module.mint_transfer_id
    draws = iter([taken])
    monkeypatch.setattr(proxy_module, "mint_transfer_id", lambda: next(draws, None) or real())
    got = pd.openai().completions.create(model="sim-model", prompt="after a collision", max_tokens=2)
    assert got.choices[0].text
    record = httpx.get(pd.url + f"/v1/handoffs/{taken}", timeout=5).json()
    assert record["state"] == "PENDING"  # the squatter's record is left alone

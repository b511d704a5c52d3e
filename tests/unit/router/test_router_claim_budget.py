"""`--decode-retries` against the ledger's `max_claims` (issue #25): each retry takes a claim back, and that
claim's lapse spends one of the record's requeues, so a router with as many retries as the ledger has
requeues would see its last retry find the KV expired. The router refuses to start so, naming both settings.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pdgate.router.settings import claim_budget_problem


@pytest.mark.parametrize(("retries", "max_claims", "ok"), [(2, 3, True), (0, 1, True), (3, 3, False), (5, 2, False)])
def test_retries_must_stay_below_max_claims(retries: int, max_claims: int, ok: bool) -> None:
    problem = claim_budget_problem(retries, max_claims)
    assert (problem is None) is ok
    if problem is not None:
        assert "--decode-retries" in problem and "--max-claims" in problem and "MAX_CLAIMS" in problem


def test_the_router_refuses_to_start_with_more_retries_than_its_embedded_ledger_allows() -> None:
    env = {**os.environ, "PDGATE_METASERVER_MAX_CLAIMS": "2", "PDGATE_ROUTER_DECODE_RETRIES": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "pdgate.router", "--port", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "invalid settings" in done.stderr and "--max-claims" in done.stderr and "(it is 2)" in done.stderr

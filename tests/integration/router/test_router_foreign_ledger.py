"""A prefill whose READY never reaches the router's ledger is named as such (issue #26 item 6): a second
router in front of PDGateConnector engines that report to another metaserver used to give the client
"decode ... answered 500", with "not claimable ... cannot move a PENDING handoff to CLAIMED" in its log.

What the router sees in that case: the prefill answers 200 with `kv_transfer_params` naming the router's
transfer id (a connector names it, whatever ledger it reports to), and the router's handoff stays PENDING.
`pdgate-sim` records READY in the ledger the router names in the request when there is one (a connector
never does), so the test's router names none (a wildcard `--host`, embedded ledger) and its sims have
no ledger of their own: they answer as a connector on another ledger does, and nothing reaches the
router's. Real sockets: the router in a uvicorn thread, the sims as processes, the `openai` client.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.router.conftest import Deployment, Sim, start_sims
from tests.support.ports import wait_until


@pytest.fixture
def foreign(request: pytest.FixtureRequest) -> Iterator[tuple[Deployment, Sim, Sim]]:
    prefill, decode = start_sims([("prefill", ()), ("decode", ())])
    whole = getattr(request, "param", False)
    d = Deployment(host="0.0.0.0", prefill=[prefill.url], decode=[decode.url], whole_on_failure=whole)
    d.sims += [prefill, decode]
    with d:
        d.wait_available(prefill.id, decode.id)
        yield d, prefill, decode


def test_a_handoff_left_pending_by_a_prefill_that_answered_is_a_typed_kv_not_ready(  # --no-whole-on-failure
    foreign: tuple[Deployment, Sim, Sim],
) -> None:
    d, prefill, decode = foreign
    with pytest.raises(openai.APIStatusError) as caught:
        d.openai(timeout=60).completions.create(model="sim-model", prompt="hello there", max_tokens=4)
    err = caught.value
    assert err.status_code == 504 and err.response.headers["x-pdgate-error"] == "pd_kv_not_ready"
    message = err.response.json()["error"]["message"]
    assert "stayed PENDING in this router's ledger" in message
    assert "reports its handoffs to another metaserver" in message and "metaserver_url" in message
    assert prefill.url not in message and prefill.id not in message  # the client reads the opaque name only
    assert prefill.count("prefill") == 1
    assert decode.count("requests") == 0  # no decode was sent a handoff it could never claim

    tid = re.search(r"transfer (\S+),", message)
    assert tid is not None

    def aborted() -> bool:
        h = httpx.get(f"{d.url}/v1/handoffs/{tid.group(1)}", timeout=10).json()
        return h["state"] == "ABORTED" and h["reason"] == "kv_not_ready"

    wait_until(aborted, timeout=20, what="the handoff aborted as kv_not_ready")


@pytest.mark.parametrize("foreign", [True], indirect=True)
def test_with_whole_on_failure_the_request_is_served_whole_and_the_cause_counted(
    foreign: tuple[Deployment, Sim, Sim],
) -> None:
    """The default: a fault costs latency, not an error (issue #24). The prompt is computed again whole
    on an instance, the answer says so (X-PDGate-Path: whole), and the counter names why."""
    d, _, _ = foreign
    raw = d.openai(timeout=60).completions.with_raw_response.create(
        model="sim-model", prompt="hello there", max_tokens=4
    )
    assert raw.headers["x-pdgate-path"] == "whole"
    assert raw.parse().choices[0].text
    metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert re.search(r'pdgate_router_undisaggregated_total\{reason="kv_not_ready"\} 1\.0', metrics), metrics[-2000:]

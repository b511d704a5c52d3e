"""2P1D: a second prefill joins the running stack; requests spread over both prefills, and the decode
pulls each request's KV from the prefill that computed it, found through the ledger.

If the decode pulled from the wrong prefill (or the wrong blocks), its KV would belong to another
prompt and the output would differ from the single instance's.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack

from pdgate.models import HandoffState, Instance
from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import complete, delta, get_handoff, prompt_ids, settled, wait_for

pytestmark = pytest.mark.e2e


def _available(stack: LocalStack, role: str) -> set[str]:
    with httpx.Client(timeout=10, trust_env=False) as client:
        body = client.get(stack.url + "/health", headers=stack.admin_headers).json()  # ids: the admin's view
    return {i["id"] for i in body["instances"] if i["role"] == role and i["available"]}


def _registered(stack: LocalStack, instance_id: str) -> Instance:
    with httpx.Client(timeout=10, trust_env=False) as client:
        resp = client.get(f"{stack.metaserver_url}/v1/instances/{instance_id}", headers=stack.admin_headers)
        resp.raise_for_status()
    return Instance.model_validate(resp.json())


def test_two_prefills_serve_and_decode_pulls_from_the_right_one(
    pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    if len(pd_stack.by_role("prefill")) < 2:
        pd_stack.add_instance("prefill")  # registers itself; the router pairs it once it sees it
    prefills = pd_stack.by_role("prefill")
    [decode] = pd_stack.by_role("decode")
    ids = {p.instance_id for p in prefills}
    assert len(ids) == 2
    wait_for(lambda: _available(pd_stack, "prefill") == ids, timeout=60, what="the router to use both prefills")
    engine_ids = {i: _registered(pd_stack, i).engine_id for i in ids}
    before = {p.instance_id: settled(p) for p in prefills}
    d0 = settled(decode)

    records = []
    for i in range(8):
        prompt = prompt_ids(60 + 97 * i, seed=700 + i)
        got = complete(router_client, prompt, stream=bool(i % 2))
        assert got.token_ids == baseline.complete(prompt).token_ids, f"request {i} differs from the single instance"
        records.append(get_handoff(pd_stack.metaserver_url, got.headers["x-request-id"], pd_stack.admin_token))

    served = Counter(r.prefill_instance_id for r in records)
    assert set(served) == ids, f"requests did not spread over both prefills: {served}"
    for r in records:
        assert r.decode_instance_id == decode.instance_id
        assert r.location is not None and r.location.engine_id == engine_ids[r.prefill_instance_id]
    wait_for(
        lambda: all(
            get_handoff(pd_stack.metaserver_url, r.transfer_id, pd_stack.admin_token).state is HandoffState.DONE
            for r in records
        ),
        timeout=60,
        what="every handoff to be DONE",
    )
    for p in prefills:
        d = delta(settled(p), before[p.instance_id])
        assert d["ready_recorded"] == served[p.instance_id], (p.instance_id, d)
    assert delta(settled(decode), d0)["recv_ok"] == len(records)

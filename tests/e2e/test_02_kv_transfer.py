"""The KV really travelled: decode pulled the prompt's blocks from prefill and computed none of them.

Three independent witnesses per request: the connector's counters on decode (blocks and tokens
pulled), vLLM's own accounting on decode (`vllm:prompt_tokens_by_source`: external_kv_transfer vs
local_compute), and the handoff ledger (the record names the prefill that computed the KV and the
decode that claimed it, and ended DONE). A negative control lives in test_06_negative_control.py.
"""

from __future__ import annotations

import math

import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack
from pdgate.metaserver.models import HandoffState

from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import complete, delta, get_handoff, observe, prompt_ids, settled, wait_for

pytestmark = pytest.mark.e2e

BLOCK = 32


@pytest.mark.parametrize("length", [32, 33, 64, 65, 100, 1000, 4000])
def test_decode_pulls_every_prompt_block_from_prefill(
    length: int, pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    [prefill] = pd_stack.by_role("prefill")
    [decode] = pd_stack.by_role("decode")
    prompt = prompt_ids(length, seed=300)
    want = baseline.complete(prompt)
    d0, p0 = settled(decode), settled(prefill)

    got = complete(router_client, prompt)

    assert got.token_ids == want.token_ids
    wait_for(
        lambda: delta(observe(decode), d0)["recv_ok"] >= 1,
        timeout=30,
        what="decode's connector to count the pull",
    )
    d = delta(settled(decode), d0)
    p = delta(settled(prefill), p0)
    full_blocks = length // BLOCK
    assert d["recv_ok"] == 1 and d["recv_failed"] == 0 and d["pulls_failed"] == 0, d
    assert full_blocks <= d["blocks_pulled"] <= math.ceil(length / BLOCK), d
    # vLLM's accounting: the prompt tokens came over the transfer, decode computed at most the last one
    # (which it always recomputes to sample the first token: counted as local by a synchronous load,
    # the connector's path for an idle decode, and as external by an asynchronous one).
    assert d["tokens_external_kv_transfer"] >= length - 1, d
    assert d["tokens_external_kv_transfer"] + d["tokens_local_compute"] == length, d
    assert d["tokens_local_compute"] <= 1, d
    assert d["tokens_local_cache_hit"] == 0, d
    assert p["ready_recorded"] == 1 and p["sends_held"] == 1, p
    # The ledger: this request's KV was recorded by this prefill and claimed and finished by this decode.
    record = get_handoff(pd_stack.metaserver_url, got.headers["x-request-id"], pd_stack.admin_token)
    assert record.prefill_instance_id == prefill.instance_id
    assert record.decode_instance_id == decode.instance_id
    assert record.location is not None and record.location.num_tokens >= full_blocks * BLOCK
    wait_for(
        lambda: (
            get_handoff(pd_stack.metaserver_url, record.transfer_id, pd_stack.admin_token).state is HandoffState.DONE
        ),
        timeout=30,
        what=f"handoff {record.transfer_id} to be DONE",
    )

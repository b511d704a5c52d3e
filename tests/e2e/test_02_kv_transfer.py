"""The KV really travelled: decode pulled the prompt's blocks from prefill and computed none of them.

Three independent witnesses per request: the connector's counters on decode (blocks and tokens
pulled), vLLM's own accounting on decode (`vllm:prompt_tokens_by_source`: external_kv_transfer vs
local_compute), and the handoff ledger (the record names the prefill that computed the KV and the
decode that claimed it, and ended DONE). A negative control lives in test_15_layerwise.py
(a decode whose pulled KV is corrupted answers differently).
"""

from __future__ import annotations

import math
import os

import httpx
import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack
from pdgate.deploy.local.tiny_model import MODEL_NAME

from pdgate.contract import decode_request, prefill_request
from pdgate.models import HandoffState
from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import (
    MAX_TOKENS,
    complete,
    delta,
    get_handoff,
    metric,
    observe,
    prompt_ids,
    settled,
    wait_for,
)

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


FIRST_TOKEN = "pdgate_router_first_token_from_prefill_total"


def _first_tokens(router_url: str, taken: str) -> float:
    try:
        return metric(router_url, FIRST_TOKEN, {"taken": taken})
    except AssertionError:  # the counter's child appears at its first increment
        return 0.0


def _prompt_whose_first_token(baseline: Baseline, length: int, *, whole: bool) -> list[int]:
    """A prompt of `length` random tokens whose first output token, alone, is (`whole`) or is not a whole
    character: the tiny model's byte-level vocabulary often starts an answer inside a UTF-8 character,
    and such a first token keeps the classic path (`first_token.read`)."""
    for seed in range(310, 410):
        prompt = prompt_ids(length, seed=seed)
        text = baseline.complete(prompt, max_tokens=1).text
        if (bool(text) and not text.endswith("\ufffd")) == whole:
            return prompt
    raise AssertionError(f"no prompt of {length} tokens in 100 seeds starts its answer with whole={whole}")


@pytest.mark.parametrize("length", [31, 32, 33, 300, 2048])
def test_a_streamed_completions_first_token_comes_from_the_prefill(
    length: int, pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    """The router streams the prefill's first token and the decode continues after it
    (router/first_token.py): the answer is still the single instance's, token for token, with its usage,
    and the decode loaded every prompt token from the prefill (its own prompt ends with the first token,
    whose position is the one it computes)."""
    [decode] = pd_stack.by_role("decode")
    prompt = _prompt_whose_first_token(baseline, length, whole=True)
    want = baseline.complete(prompt)
    taken0, classic0 = _first_tokens(pd_stack.url, "true"), _first_tokens(pd_stack.url, "false")
    d0 = settled(decode)

    got = complete(router_client, prompt, stream=True)

    assert got.same_output(want), f"PD output differs from the single instance for {length} tokens"
    assert got.prompt_tokens == length and len(got.token_ids) == MAX_TOKENS
    assert (_first_tokens(pd_stack.url, "true"), _first_tokens(pd_stack.url, "false")) == (taken0 + 1, classic0)
    d = delta(settled(decode), d0)
    assert d["recv_ok"] == 1 and d["recv_failed"] == 0, d
    assert d["tokens_loaded"] == length, d


def test_a_first_token_inside_a_character_keeps_the_classic_path(
    pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    """vLLM shows an incomplete UTF-8 character as U+FFFD until the next token completes it: the client
    must get the character whole, as one vLLM streams it, so the decode sends every token."""
    prompt = _prompt_whose_first_token(baseline, 64, whole=False)
    want = baseline.complete(prompt)
    taken0, classic0 = _first_tokens(pd_stack.url, "true"), _first_tokens(pd_stack.url, "false")

    got = complete(router_client, prompt, stream=True)

    assert got.same_output(want)
    assert (_first_tokens(pd_stack.url, "true"), _first_tokens(pd_stack.url, "false")) == (taken0, classic0 + 1)


def test_a_stream_with_a_stop_string_keeps_the_classic_path(
    pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    """A stop string could span the first and second token, which the decode would not see together."""
    prompt = prompt_ids(100, seed=311)
    want = baseline.complete(prompt)
    taken0 = _first_tokens(pd_stack.url, "true")
    stream = router_client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stop=["\x00never"],
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == want.text
    assert _first_tokens(pd_stack.url, "true") == taken0


def test_a_decode_given_another_prompts_kv_computes_its_own_prompt(pd_stack: LocalStack, baseline: Baseline) -> None:
    """The prefill's KV names the prompt it belongs to (`connector.blocks.prompt_digest`). A decode reached
    with that KV's params but another prompt of the same length (a client driving vLLM directly, a
    broken proxy) must not decode on another text's keys and values: it releases the KV and computes its
    own prompt, so its answer is still the single instance's for its prompt."""
    [prefill] = pd_stack.by_role("prefill")
    [decode] = pd_stack.by_role("decode")
    admin = {"Authorization": f"Bearer {pd_stack.admin_token}"}
    tid = "pd-" + os.urandom(16).hex()
    kv_prompt, own_prompt = prompt_ids(96, seed=320), prompt_ids(96, seed=321)
    d0 = settled(decode)
    with httpx.Client(timeout=120, trust_env=False) as http:
        created = http.post(
            pd_stack.metaserver_url + "/v1/handoffs",
            json={"prefill_instance_id": prefill.instance_id, "transfer_id": tid},
            headers=admin,
        ).raise_for_status()
        kv_key = created.json()["kv_key"]
        params = prefill_request(tid, kv_key=kv_key, metaserver=pd_stack.metaserver_url)
        body = {"model": MODEL_NAME, "prompt": kv_prompt, "max_tokens": 1, "kv_transfer_params": params}
        answer = http.post(prefill.url + "/v1/completions", json=body).raise_for_status().json()
        forwarded = decode_request(answer["kv_transfer_params"], tid, kv_key=kv_key)
        body = {
            "model": MODEL_NAME,
            "prompt": own_prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": forwarded,
        }
        got = http.post(decode.url + "/v1/completions", json=body).raise_for_status().json()
    assert got["choices"][0]["token_ids"] == list(baseline.complete(own_prompt).token_ids)
    d = delta(settled(decode), d0)
    assert d["prompt_mismatch"] == 1 and d["tokens_loaded"] == 0 and d["recv_ok"] == 0, d
    wait_for(
        lambda: get_handoff(pd_stack.metaserver_url, tid, pd_stack.admin_token).state.terminal,
        timeout=30,
        what=f"handoff {tid} released by the decode",
    )

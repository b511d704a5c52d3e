"""1P1D through the router gives the single instance's tokens, token for token.

Prompt lengths cover the block edges (block size 32): below one block, exactly one, one plus one,
lengths where length-1 is a multiple of the block size (the edge a prefix-keyed store misses), several
blocks, and the model's limit. Every case uses a prompt of its own, so each one is a fresh prefill and
a fresh transfer rather than a prefix-cache hit.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack

from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import MAX_TOKENS, chat, chat_messages, complete, prompt_ids

pytestmark = pytest.mark.e2e

BLOCK = 32
MODEL_LIMIT = 4096  # --max-model-len of the local stack
LENGTHS = [7, 31, 32, 33, 64, 65, 97, 129, 300, 1000, 2048, MODEL_LIMIT - MAX_TOKENS]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("length", LENGTHS)
def test_completion_matches_single_instance(
    length: int, stream: bool, pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    prompt = prompt_ids(length, seed=100 + int(stream))
    want = baseline.complete(prompt)
    got = complete(router_client, prompt, stream=stream)
    assert got.prompt_tokens == length
    assert len(got.token_ids) == MAX_TOKENS
    assert got.token_ids == want.token_ids, f"PD output differs from the single instance for {length} tokens"
    assert got.text == want.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("n_words", [2, 30, 300])
def test_chat_matches_single_instance(
    n_words: int, stream: bool, pd_stack: LocalStack, router_client: OpenAI, baseline: Baseline
) -> None:
    messages = chat_messages(n_words, seed=200 + int(stream))
    want = baseline.chat(messages)
    got = chat(router_client, messages, stream=stream)
    assert got.prompt_tokens == want.prompt_tokens
    assert got.token_ids == want.token_ids, f"PD chat output differs from the single instance ({n_words} words)"
    assert got.text == want.text

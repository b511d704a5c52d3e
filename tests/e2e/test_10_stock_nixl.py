"""pdgate-router in front of vLLM's own NixlConnector 1P1D gives the single instance's tokens.

The operator's first step (docs/NIXL.md): keep the engines as vLLM ships them (`NixlConnector`, prefill
`kv_producer`, decode `kv_consumer`, no pdgate code inside vLLM) and put the router in front with static
`--prefill`/`--decode` URLs. The router forwards NIXL's own `kv_transfer_params` from the prefill's answer
to the decode unchanged and makes no ledger claim (NIXL's prefill does not name the handoff).

What is asserted, on real vLLM:
- completions (whole and streamed) and chat through the router equal the single instance token for token;
- each request's KV really crossed over NIXL: the decode's `vllm:nixl_xfer_time_seconds` histogram counts
  one transfer per request, none failed, and the decode took the prompt from the transfer (vLLM's
  `prompt_tokens_by_source`), computing locally only the tail NIXL does not carry. A router that dropped
  or mangled NIXL's params would still give the right tokens (the decode would recompute the prompt),
  which is why the transfer itself is counted.

The pair is started here, after the main stack is stopped, and stopped at the end of the module (two
engines, about a minute on 2 cores); the next module to ask for the main stack starts it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pdgate.deploy.local.vllm_env import VllmEnv

from tests.e2e.conftest import Baseline, Stacks, answers_equal_the_single_instances
from tests.e2e.nixl_pair import NixlPair
from tests.e2e.pdclient import (
    delta,
    engine_counters,
    metric,
    openai_client,
    prompt_ids,
    scrape,
)

pytestmark = pytest.mark.e2e

LENGTHS = [7, 33, 300, 2048]
XFERS = "vllm:nixl_xfer_time_seconds_count"


@pytest.fixture(scope="module")
def nixl_pair(stacks: Stacks, e2e_run_dir: Path, model_dir: Path, vllm_env: VllmEnv) -> Iterator[NixlPair]:
    # Free the cores first. With the main stack's four engines beside NIXL's busy threads on 2 cores, the
    # main engines' heartbeats starved past their 15 s lease, the metaserver dropped main's decode, and the
    # next module (test_drop_in) met a router with no decode (CI, fb344d2: 19 answers of 503 pd_no_compatible_pair).
    stacks.stop_main()
    pair = NixlPair(
        model_dir=model_dir,
        run_dir=e2e_run_dir / "stock-nixl",
        venv=vllm_env.venv,
        log=lambda m: print(f"[e2e] stock-nixl: {m}", flush=True),
    )
    with pair:
        yield pair


def _xfers(url: str) -> float:
    try:
        return metric(url, XFERS)
    except AssertionError:  # vLLM registers the histogram's samples at the first transfer
        return 0.0


def test_router_over_stock_nixl_gives_the_single_instance_tokens(nixl_pair: NixlPair, baseline: Baseline) -> None:
    client = openai_client(nixl_pair.openai_base_url)
    decode = nixl_pair.engine("decode").url
    x0, c0 = _xfers(decode), engine_counters(decode)
    fresh = [(prompt_ids(length, seed=1000 + i), i % 2 == 1) for i, length in enumerate(LENGTHS)]  # no cache hit
    sent, prompt_tokens = answers_equal_the_single_instances(client, baseline, fresh, chat_seed=1100)

    assert _xfers(decode) - x0 == sent, "the decode should have read every request's KV over NIXL"
    failed = sum(v for n, _, v in scrape(decode) if n == "vllm:nixl_num_failed_transfers_total")
    assert failed == 0
    d = delta(engine_counters(decode), c0)
    print(f"[e2e] stock-nixl decode prompt tokens by source over {sent} requests: {d}")
    transferred = d.get("tokens_external_kv_transfer", 0.0)
    local = d.get("tokens_local_compute", 0.0)
    assert transferred + local + d.get("tokens_local_cache_hit", 0.0) == prompt_tokens, d
    assert local <= sent, d  # at most the last prompt token each: the rest came over NIXL

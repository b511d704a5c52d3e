"""The router with --kv-events: vLLM's own publisher says which prefill holds a prompt, and the
cache_aware policy sends the prompt there, against what prefix affinity alone would choose.

Over real sockets: a router (embedded metaserver), two prefill sims and a decode sim, one in-process
vLLM `ZmqEventPublisher` per prefill, the openai client sending a token-id prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import orjson
import pytest
from pdgate.router.kv_index import BlockHasher
from pdgate.router.policies.prefix_affinity import rank
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from tests.integration.router.conftest import Deployment
from tests.support.ports import free_port, wait_until

BS = 16  # the sims' advertised block size, and the events'


def _publisher() -> tuple[ZmqEventPublisher, int]:
    port = free_port()
    return ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic=""), port


def _batch(keys: list[int]) -> KVEventBatch:
    hashes = [k.to_bytes(8, "big") for k in keys]  # the index keeps the low 64 bits: these are them
    ev = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[0] * BS * len(keys),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(ts=time.time(), events=[ev])


@pytest.fixture
def deployment() -> Iterator[tuple[Deployment, ZmqEventPublisher, ZmqEventPublisher]]:
    pa, port_a = _publisher()
    pb, port_b = _publisher()
    kv = [f"pa=tcp://127.0.0.1:{port_a}", f"pb=tcp://127.0.0.1:{port_b}"]
    try:
        with Deployment(prefill_policy="cache_aware", kv_events=kv) as dep:
            dep.add_many([("prefill", ["--instance-id", "pa"]), ("prefill", ["--instance-id", "pb"]), ("decode", [])])
            dep.wait_available("pa", "pb")
            yield dep, pa, pb
    finally:
        pa.shutdown()
        pb.shutdown()


def _prompt_affinity_prefers(target: int) -> list[int]:
    """A token prompt (8 blocks) that prefix affinity alone would send to candidate `target` (0: pa, 1: pb)."""
    for seed in range(1000):
        prompt = [seed * 1000 + i for i in range(8 * BS)]
        if rank(orjson.dumps(prompt[:256]), ["pa", "pb"])[0] == target:
            return prompt
    raise AssertionError("no prompt found")


def test_the_prefill_holding_the_prompt_gets_it(
    deployment: tuple[Deployment, ZmqEventPublisher, ZmqEventPublisher],
) -> None:
    dep, pa, _pb = deployment
    prompt = _prompt_affinity_prefers(1)  # affinity says pb; the events say pa holds it
    keys = BlockHasher(BS).keys(prompt)
    index = dep.app._holder["kv_events"].index

    def held() -> bool:  # PUB/SUB drops what precedes the subscription: publish until it lands
        if index.matched("pa", keys) < len(keys):
            pa.publish(_batch(keys))
            return False
        return True

    wait_until(held, timeout=20, what="pa's events in the router's index")
    client = openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
    assert [s.count("prefill") for s in dep.by_role("prefill")] == [4, 0]  # started in order: pa, pb
    text = dep.app.metrics.render().decode()
    applied = [
        ln for ln in text.splitlines() if ln.startswith('pdgate_router_kv_event_batches_total{outcome="applied"}')
    ]
    assert applied and float(applied[0].split()[-1]) >= 1
    # What the index holds per instance, read at scrape time: pa's 8 blocks, nothing for pb.
    blocks = {
        ln.split('"')[1]: float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith("pdgate_router_kv_index_blocks{")
    }
    assert blocks.get("pa") == len(keys) and blocks.get("pb", 0) == 0

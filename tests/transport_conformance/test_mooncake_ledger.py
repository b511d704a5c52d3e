"""The Mooncake session and buffer descriptors travel through the ledger's KV location, as NIXL's do.

A prefill and a decode transport, each built by the factory from a connector config, a 48-layer KV cache
allocated back to back (one registration, as vLLM allocates it). The prefill's address goes through the
connector's own path (`addresses_from_workers` -> `location_for` -> the `KVLocation` JSON the metaserver
stores -> `plan_for`) and the decode pulls what the plan says: every byte must arrive. It would catch an
address that does not survive the wire model (the `meta` bounds, `host`/`port` fields), a pairing rule that
refuses mooncake with mooncake, or a registration per layer instead of one.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
from pdgate.connector.config import ServerFacts, parse_config
from pdgate.connector.location import EngineFacts, addresses_from_workers, location_for, plan_for
from pdgate.connector.transport.base import KVRegion, PullRequest
from pdgate.connector.transport.factory import make_transport

from pdgate.models import KVLocation

LAYERS, BLOCKS, BLOCK_LEN, BLOCK_SIZE = 48, 32, 2048, 16

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="package 'mooncake' is not installed (pdgate[mooncake])"
)


def facts(role: str) -> EngineFacts:
    return EngineFacts(
        instance_id=f"{role}-0",
        engine_id=f"{role}-engine",
        host="127.0.0.1",
        dp_rank=0,
        tp_size=1,
        world_size=1,
        block_size=BLOCK_SIZE,
        kv_dtype="float16",
        kv_layout="nhd",
        kv_replicated=False,
        transport="mooncake",
    )


def cache(buf: np.ndarray) -> list[KVRegion]:
    """One allocation, every layer back to back: what vLLM registers."""
    size = BLOCKS * BLOCK_LEN
    return [KVRegion.dense(f"layer{i}", buf.ctypes.data + i * size, BLOCK_LEN, BLOCKS) for i in range(LAYERS)]


def test_a_pull_planned_from_the_ledgers_location_moves_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOG_minloglevel", "1")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "0")  # so that the undo removes what the factory writes
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC")
    extra = {"metaserver_url": "http://127.0.0.1:8300", "url": "http://127.0.0.1:8100", "transport": "mooncake"}
    p_cfg = parse_config(extra, ServerFacts(kv_role="kv_producer", host="127.0.0.1", port=8100, served_model="m"))
    d_cfg = parse_config(
        {**extra, "url": "http://127.0.0.1:8200"},
        ServerFacts(kv_role="kv_consumer", host="127.0.0.1", port=8200, served_model="m"),
    )
    src = np.random.default_rng(3).integers(0, 256, LAYERS * BLOCKS * BLOCK_LEN, dtype=np.uint8)
    dst = np.zeros_like(src)
    prefill = make_transport(p_cfg, tp_rank=0, dp_rank=0, tp_size=1)
    decode = make_transport(d_cfg, tp_rank=0, dp_rank=0, tp_size=1)
    try:
        prefill.register(cache(src))
        decode.register(cache(dst))
        address = prefill.local_address()
        assert address["session"] == f"127.0.0.1:{address['port']}"
        assert address["buffers"] == [[src.ctypes.data, src.nbytes]]  # one registration for 48 layers

        remote_blocks = [5, 6, 7, 20, 3]
        location, kept = location_for(
            facts("prefill"),
            block_ids=remote_blocks,
            num_tokens=len(remote_blocks) * BLOCK_SIZE,
            addresses=addresses_from_workers({0: address}),
            remote_request_id="req-1",
        )
        stored = KVLocation.model_validate_json(location.model_dump_json())  # what the metaserver hands back
        local_blocks = [9, 10, 11, 0, 31]
        plan = plan_for(
            stored,
            facts("decode"),
            transfer_id="t-1",
            kv_key=42,
            req_id="r",
            local_block_ids=local_blocks,
            hit_blocks=0,
        )
        decode.start_pull(
            PullRequest(plan.transfer_id, plan.kv_key, plan.sources[0], plan.remote_block_ids, plan.local_block_ids)
        )
        deadline = time.monotonic() + 15
        results = []
        while not results and time.monotonic() < deadline:
            results = decode.poll()
            time.sleep(0.001)
        assert results and results[0].ok, results
        got, want = dst.reshape(LAYERS, BLOCKS, BLOCK_LEN), src.reshape(LAYERS, BLOCKS, BLOCK_LEN)
        np.testing.assert_array_equal(got[:, local_blocks], want[:, kept])
        others = [b for b in range(BLOCKS) if b not in local_blocks]
        assert not got[:, others].any()
    finally:
        decode.close()
        prefill.close()

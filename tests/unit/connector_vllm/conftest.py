"""Helpers for the connector tests that need vLLM itself (run them with the vLLM venv).

They build vLLM's own objects: `VllmConfig` from a config-only model folder (no weights, no tokenizer),
`vllm.v1.request.Request`, `KVCacheBlock`/`KVCacheBlocks`, and a real `Scheduler` whose connector is
`PDGateConnector` loaded through `kv_connector_module_path="pdgate.connector"`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.support.servers import UvicornThread

if TYPE_CHECKING:
    from tests.unit.connector_vllm.engine_support import Engine

BLOCK_SIZE = 32
NUM_KV_HEADS = 2
HEAD_SIZE = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

# The tiny Llama's shape (deploy/local/tiny_model.py), without weights: enough for ModelConfig.
_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config-only-model")
    (path / "config.json").write_text(json.dumps(_CONFIG))
    return path


def vllm_config(
    model_dir: Path,
    *,
    kv_role: str,
    extra: dict[str, Any],
    kv_load_failure_policy: str = "fail",
    num_blocks: int = 200,
    kv_connector_module_path: str | None = "pdgate.connector",
) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=1024)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=True,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True)
    kv = KVTransferConfig(
        kv_connector="PDGateConnector",
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=kv_load_failure_policy,
    )
    cfg = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_cache_config(num_blocks: int = 200) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)]
    )


def make_scheduler(cfg: VllmConfig, num_blocks: int = 200) -> Scheduler:
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
    )


def make_request(
    req_id: str, prompt_len: int, params: dict[str, Any] | None, *, max_tokens: int = 16, first_token: int = 3
) -> Request:
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(
        request_id=req_id,
        prompt_token_ids=[first_token + i for i in range(prompt_len)],
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    req.kv_transfer_params = params
    return req


def make_blocks(block_ids: list[int], *, cached: int = 0) -> KVCacheBlocks:
    """A request's block table as vLLM hands it to update_state_after_alloc: the first `cached` blocks
    are local prefix-cache hits (they carry a hash), the rest are fresh."""
    blocks = [KVCacheBlock(b) for b in block_ids]
    for i, block in enumerate(blocks[:cached]):
        block.set_block_hash(make_block_hash_with_group_id(bytes([i + 1]) * 8, 0))
    return KVCacheBlocks((blocks,))


@pytest.fixture(scope="session")
def metaserver() -> Iterator[UvicornThread]:
    """A real metaserver (memory store) over a real socket. The expiry tests name their own short leases;
    a READY handoff otherwise waits 5 minutes, not the service's 30 s: on a loaded CI host (mypy and three
    workers on two cores) a prefill's answer took ~30 s to reach test_server.py, and its READY was most
    likely swept before the test looked."""
    settings = MetaSettings(store="memory://", ready_lease_s=300.0, claim_lease_s=10.0, sweep_interval_s=0.05)
    server = UvicornThread(create_app(settings)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def engines(
    model_dir: Path, metaserver: UvicornThread, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode engine (`engine_support.Engine`) on the real metaserver."""
    from tests.unit.connector_vllm.engine_support import TOKEN, Engine

    # The admin token is what the router's claim is sealed with (pdgate.claim_seal); this
    # metaserver has none configured and takes any caller on loopback. An indirect parameter adds
    # connector settings for the decode.
    decode_extra: dict[str, Any] = getattr(request, "param", {})
    p = Engine(model_dir, metaserver.url, "kv_producer", tmp_path, metaserver_token=TOKEN)
    d = Engine(model_dir, metaserver.url, "kv_consumer", tmp_path, metaserver_token=TOKEN, **decode_extra)
    try:
        yield p, d
    finally:
        p.close()
        d.close()

"""The router hashes a prompt's blocks exactly as vLLM 0.32 does (its own functions as the oracle)."""

from __future__ import annotations

import random

from pdgate.router.kv_index import DEFAULT_SEED, BlockHasher, block_key
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu


def _vllm_keys(tokens: list[int], block_size: int) -> list[int]:
    kcu.init_none_hash(sha256)
    parent = None
    out = []
    for i in range(len(tokens) // block_size):
        parent = kcu.hash_block_tokens(sha256, parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(block_key(kcu.maybe_convert_block_hash(parent)))
    return out


def test_block_keys_match_vllms_default_hash(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert kcu.DEFAULT_NONE_HASH_SEED == DEFAULT_SEED
    rng = random.Random(7)
    for block_size in (16, 64):
        tokens = [rng.randrange(150_000) for _ in range(block_size * 5 + 3)]
        assert BlockHasher(block_size).keys(tokens) == _vllm_keys(tokens, block_size)


def test_an_engine_seed_is_followed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    tokens = list(range(48))
    assert BlockHasher(16, seed="1234").keys(tokens) == _vllm_keys(tokens, 16)
    monkeypatch.delenv("PYTHONHASHSEED")
    kcu.init_none_hash(sha256)

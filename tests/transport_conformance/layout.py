"""The KV layout every conformance peer serves and every decode pulls into, and the bytes to expect.

A peer holds two regions (K and V) in ONE buffer. ``interleaved`` puts them block by block
(``[blk0 K][blk0 V][blk1 K]...``, stride = 2 blocks: what a NIXL or Mooncake peer registers as one extent);
``dense`` puts all K blocks, then all V blocks (llm_datadist describes each region as one dense tensor).
A decode holds one dense buffer per region, so the two sides never share a layout by accident.
"""

from __future__ import annotations

import numpy as np
from pdgate.connector.transport.base import KVRegion

REGION_NAMES = ("k", "v")
NUM_BLOCKS = 256
BLOCK_LEN = 4096


def peer_buffer(seed: int) -> np.ndarray:
    """The peer's bytes: seeded, so the test process can compute them without asking."""
    return np.random.default_rng(seed).integers(0, 256, size=NUM_BLOCKS * 2 * BLOCK_LEN, dtype=np.uint8)


def peer_regions(buf: np.ndarray, layout: str) -> list[KVRegion]:
    base = buf.ctypes.data
    names = enumerate(REGION_NAMES)
    if layout == "interleaved":
        return [KVRegion(n, base + i * BLOCK_LEN, BLOCK_LEN, NUM_BLOCKS, 2 * BLOCK_LEN) for i, n in names]
    return [KVRegion.dense(n, base + i * NUM_BLOCKS * BLOCK_LEN, BLOCK_LEN, NUM_BLOCKS) for i, n in names]


def peer_block(buf: np.ndarray, layout: str, region: int, block: int) -> np.ndarray:
    start = (2 * block + region) * BLOCK_LEN if layout == "interleaved" else (region * NUM_BLOCKS + block) * BLOCK_LEN
    return buf[start : start + BLOCK_LEN]


def decode_buffers() -> list[np.ndarray]:
    return [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in REGION_NAMES]


def decode_regions(bufs: list[np.ndarray]) -> list[KVRegion]:
    return [KVRegion.dense(n, b.ctypes.data, BLOCK_LEN, NUM_BLOCKS) for n, b in zip(REGION_NAMES, bufs, strict=True)]

"""The KV-event index (router/kv_index.py): memory per million blocks, and the cost of its hot paths.

Memory: the index is filled through `KVIndex.apply` with `Stored` batches of random 64-bit keys (what
`block_key` makes of vLLM's hashes), spread over `instances` instances, and measured with tracemalloc
(the index's own allocations: sets and int keys). Time: applying stored/removed batches (events in),
`matched` over a 128-block prompt against every instance (a routing decision with `cache_aware`), and
hashing a prompt's blocks as the engine does (`BlockHasher`, once per request and block size).

    .venv-vllm/bin/python bench/kv_index.py [--blocks 100000 1000000] [--instances 1 8]

Prints a table and writes bench/results/kv_index.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import tracemalloc
from pathlib import Path
from random import Random
from typing import Any

from pdgate.router.kv_index import BlockHasher, KVIndex, Removed, Stored

BATCH = 64  # blocks per Stored event: a 1,024-token prompt at block size 16


def _fill(index: KVIndex, instances: int, blocks: int, rng: Random, keep: bool = True) -> list[list[int]]:
    """Fill `index`; the keys are returned only with `keep` (kept, they would share the index's ints)."""
    per = blocks // instances
    keys: list[list[int]] = []
    for i in range(instances):
        mine: list[int] = []
        for seq in range(-(-per // BATCH)):
            batch = tuple(rng.getrandbits(64) for _ in range(min(BATCH, per - seq * BATCH)))
            index.apply(f"i{i}", seq, [Stored(batch, 16)])
            if keep:
                mine.extend(batch)
        keys.append(mine)
    return keys


def memory(instances: int, blocks: int) -> dict[str, Any]:
    rng = Random(1)
    gc.collect()
    tracemalloc.start()
    index = KVIndex(max_blocks=blocks)
    base = tracemalloc.get_traced_memory()[0]
    _fill(index, instances, blocks, rng, keep=False)
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.total() == blocks // instances * instances
    return {
        "instances": instances,
        "blocks": index.total(),
        "bytes": index_bytes,
        "bytes_per_block": round(index_bytes / index.total(), 1),
        "mb_per_million_blocks": round(index_bytes / index.total() * 1e6 / 2**20, 1),
    }


def timings(instances: int, blocks: int, seconds: float) -> dict[str, Any]:
    rng = Random(2)
    index = KVIndex(max_blocks=blocks)
    keys = _fill(index, instances, blocks, rng)
    seqs = {f"i{i}": index.expected(f"i{i}") or 0 for i in range(instances)}

    # events in: one stored and one removed batch of BATCH blocks on instance i0
    fresh = [tuple(rng.getrandbits(64) for _ in range(BATCH)) for _ in range(64)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = fresh[n % len(fresh)]
        index.apply("i0", seqs["i0"], [Stored(batch, 16)])
        index.apply("i0", seqs["i0"] + 1, [Removed(batch)])
        seqs["i0"] += 2
        n += 2
    apply_us = (time.perf_counter() - t0) / n * 1e6

    # a routing decision: a 128-block prompt, the first half held by instance 0
    prompt = keys[0][:64] + [rng.getrandbits(64) for _ in range(64)]
    ids = [f"i{i}" for i in range(instances)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for ident in ids:
            index.matched(ident, prompt)
        n += 1
    lookup_us = (time.perf_counter() - t0) / n * 1e6

    hasher = BlockHasher(16)
    tokens = [rng.randrange(150_000) for _ in range(16 * 128)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        hasher.keys(tokens)
        n += 1
    hash_us = (time.perf_counter() - t0) / n * 1e6
    return {
        "instances": instances,
        "blocks": blocks,
        "apply_us_per_batch_of_64": round(apply_us, 2),
        "lookup_us_128_blocks_all_instances": round(lookup_us, 2),
        "hash_us_2048_tokens_bs16": round(hash_us, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--instances", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_index.json"))
    args = ap.parse_args()
    mem = [memory(i, b) for b in args.blocks for i in args.instances]
    times = [timings(i, args.blocks[0], args.seconds) for i in args.instances]
    print(f"{'instances':>9} {'blocks':>9} {'MiB':>8} {'B/block':>8} {'MiB per 1M blocks':>18}")
    for m in mem:
        mib = m["bytes"] / 2**20
        row = f"{m['instances']:>9} {m['blocks']:>9} {mib:>8.1f} {m['bytes_per_block']:>8} "
        print(row + f"{m['mb_per_million_blocks']:>18}")
    print(f"\n{'instances':>9} {'apply 64 (us)':>14} {'lookup 128 x all (us)':>22} {'hash 2048 tok (us)':>19}")
    for t in times:
        row = f"{t['instances']:>9} {t['apply_us_per_batch_of_64']:>14} "
        print(row + f"{t['lookup_us_128_blocks_all_instances']:>22} {t['hash_us_2048_tokens_bs16']:>19}")
    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "memory": mem,
        "timings": times,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

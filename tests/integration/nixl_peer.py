"""Prefill-side NIXL peer for ``test_nixl_transport.py``: the second, real process.

Run as a script: it fills an interleaved K/V buffer with seeded random bytes, registers it
with a :class:`NixlTransport`, prints ``{"pid", "address"}`` as one JSON line
(prefixed with ``PREFIX``), then keeps
calling ``poll()`` every ``--poll-interval`` seconds (the prefill side must make progress) and
prints ``{"served": [...]}`` whenever a puller's notification arrives. It exits when stdin reaches
EOF, after a last poll (a notification that came during the last sleep is reported too).

The layout helpers are imported by the test to compute the bytes it expects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

REGION_NAMES = ("k", "v")
#: NIXL logs to stdout too, so protocol lines carry this prefix.
PREFIX = "PDGATE-PEER "


def emit(msg: dict[str, object]) -> None:
    print(PREFIX + json.dumps(msg), flush=True)


def prefill_buffer(num_blocks: int, block_len: int, seed: int) -> np.ndarray:
    """One buffer holding K and V interleaved per block: [blk0 K][blk0 V][blk1 K]..."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=num_blocks * 2 * block_len, dtype=np.uint8)


def prefill_block(buf: np.ndarray, region: int, block: int, block_len: int) -> np.ndarray:
    start = (2 * block + region) * block_len
    return buf[start : start + block_len]


def main() -> None:
    from pdgate.connector.transport.base import KVRegion
    from pdgate.connector.transport.nixl import NixlTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--block-len", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    # Seconds between polls. The default is a prefill holding KV (`pdgate.connector.worker`); a test may
    # pass the idle cadence instead, to show a puller's first contact needs no faster progress.
    ap.add_argument("--poll-interval", type=float, default=0.0005)
    args = ap.parse_args()

    buf = prefill_buffer(args.num_blocks, args.block_len, args.seed)
    base = buf.ctypes.data
    regions = [
        KVRegion(name, base + i * args.block_len, args.block_len, args.num_blocks, 2 * args.block_len)
        for i, name in enumerate(REGION_NAMES)
    ]
    transport = NixlTransport(agent_name=f"peer-{args.seed}", pull_timeout_s=10.0)
    transport.register(regions)
    emit({"pid": os.getpid(), "address": transport.local_address()})

    stop = threading.Event()

    def wait_for_eof() -> None:  # the parent closes our stdin to stop us
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.is_set():
        transport.poll()
        served = transport.drain_served()
        if served:
            emit({"served": served})
        time.sleep(args.poll_interval)
    transport.poll()
    served = transport.drain_served()
    if served:
        emit({"served": served})
    transport.close()


if __name__ == "__main__":
    main()

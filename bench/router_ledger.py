"""Micro-benchmark: the in-process ledger's cost per handoff (MetaService on the memory store), the part of
the embedded router's CPU that `core_errors`, the transition counter and the ledger's debug line touch.

Why a micro-benchmark: a handoff cycle is ~30 us of the embedded router's ~340 us per request, so a
change of a few us there is below the noise of `bench/router.py` on a shared 2-core box (±5% between
runs), but stable here (min of rounds, same process, nothing else in the loop).

One cycle = create, ready, claim, done through `MetaService` (what `LocalMetaClient` and the fast path
call); `claim` is also timed alone. Run it from a package tree to compare before/after:

    .venv-vllm/bin/python bench/router_ledger.py --label after
    PYTHONPATH=DIR .venv-vllm/bin/python bench/router_ledger.py --label before   # DIR/pdgate/... = old tree
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store.memory import MemoryStore

from pdgate.models import HandoffCreate, KVLocation


async def measure(n: int, rounds: int) -> dict[str, float]:
    """Best (lowest) us per handoff cycle and per claim over `rounds` rounds of `n` handoffs."""
    svc = MetaService(MemoryStore(), MetaSettings())
    loc = KVLocation(block_ids=[[1, 2]], num_tokens=16)
    best = {"cycle_us": float("inf"), "claim_us": float("inf")}
    for rnd in range(rounds):
        bodies = [HandoffCreate(prefill_instance_id="p1", transfer_id=f"t{rnd}-{i}") for i in range(n)]
        claim_s = 0.0
        t0 = time.perf_counter()
        for body in bodies:
            rec = await svc.create_handoff(body)
            await svc.mark_ready(rec.transfer_id, loc)
            t = time.perf_counter()
            await svc.claim(rec.transfer_id, "d1")
            claim_s += time.perf_counter() - t
            await svc.done(rec.transfer_id, "d1")
        best["cycle_us"] = min(best["cycle_us"], (time.perf_counter() - t0) / n * 1e6)
        best["claim_us"] = min(best["claim_us"], claim_s / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="current")
    ap.add_argument("-n", type=int, default=10000, help="handoffs per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    res = asyncio.run(measure(args.n, args.rounds))
    print(f"{args.label:<10} cycle {res['cycle_us']:6.2f} us   claim {res['claim_us']:5.2f} us")
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(
                json.dumps({"label": args.label, **res, "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
                + "\n"
            )


if __name__ == "__main__":
    main()

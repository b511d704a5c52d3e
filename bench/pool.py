"""The router's pool at fleet size (issue 12): the cost of one change, and routing decisions per second.

A change is what a registry refresh does when one instance registers or leaves: `Pool.replace` with the
new snapshot. It runs on the router's event loop, so its time is time no request is served. A routing
decision is what every request does before it dispatches: the eligible prefills of its model, the
least-loaded one, the eligible decodes that can take its KV, the least-loaded one.

Fleets: P prefills x D decodes of one model, spread over `classes` compatibility classes (block size,
KV dtype, TP: what `pdgate.contract.mismatch` compares), with some instances unavailable.
Prints a table and writes bench/results/pool.json. `--pool-file` measures another version of
router/pool.py instead (the pair-by-pair one before issue 12, for the before/after figures):

    .venv-vllm/bin/python bench/pool.py [--sizes 100 1000] [--classes 1 8] [--seconds 2]
    git show 59fb109:router/pool.py > /tmp/pool_before.py
    .venv-vllm/bin/python bench/pool.py --pool-file /tmp/pool_before.py --out /tmp/pool_before.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from random import Random
from typing import Any


def _pool_module_from_argv() -> None:
    """With --pool-file, that file is imported as pdgate.router.pool before anything else imports it."""
    if "--pool-file" in sys.argv:
        import importlib.util

        path = sys.argv[sys.argv.index("--pool-file") + 1]
        spec = importlib.util.spec_from_file_location("pdgate.router.pool", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pdgate.router.pool"] = module
        spec.loader.exec_module(module)


_pool_module_from_argv()

from pdgate.router.bodies import RequestFacts  # noqa: E402
from pdgate.router.pairing import InstanceView  # noqa: E402
from pdgate.router.policies import make_policy  # noqa: E402
from pdgate.router.pool import Pool  # noqa: E402

from pdgate.models import Role  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FACTS = RequestFacts(endpoint="/v1/completions", model="m", stream=False, prompt_tokens=64, max_tokens=16, prefix=b"")
SHAPES = [(bs, dt, tp) for bs in (16, 32) for dt in ("auto", "fp8") for tp in (1, 2)]


def fleet(n: int, classes: int) -> list[InstanceView]:
    views = []
    for role, tag in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
        for i in range(n):
            bs, dt, tp = SHAPES[i % classes]
            views.append(
                InstanceView(
                    id=f"{tag}{i:05d}",
                    role=role,
                    url=f"http://10.{int(role is Role.DECODE)}.{i // 250}.{i % 250}:8000",
                    model="m",
                    block_size=bs,
                    kv_dtype=dt,
                    tp_size=tp,
                )
            )
    return views


def one_change(n: int, classes: int, rounds: int) -> dict[str, float]:
    views = fleet(n, classes)
    extra = InstanceView(id="p99999", role=Role.PREFILL, url="http://10.9.9.9:8000", model="m", block_size=16)
    pool = Pool()
    t = time.perf_counter()
    pool.replace(views)
    first = time.perf_counter() - t
    adds, removes = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        pool.replace([*views, extra])
        adds.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.replace(views)
        removes.append(time.perf_counter() - t)
    return {
        "first_snapshot_ms": round(first * 1e3, 2),
        "register_one_ms": round(statistics.median(adds) * 1e3, 2),
        "remove_one_ms": round(statistics.median(removes) * 1e3, 2),
    }


def decisions(n: int, classes: int, seconds: float) -> dict[str, float]:
    pool = Pool()
    pool.replace(fleet(n, classes))
    rng = Random(1)
    for inst in pool.instances.values():  # some load, some instances out of rotation
        inst.requests = rng.randrange(16)
        if rng.random() < 0.05:
            pool.set_health(inst.view.url, False, "down")
    policy = make_policy("least_load")
    done = 0
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        ps = pool.prefill_candidates("m", 0.0)
        p = ps[policy.choose(ps, FACTS, rng) or 0]
        ds = pool.decode_candidates(p, 0.0)
        ds[policy.choose(ds, FACTS, rng) or 0]
        done += 1
    return {"decisions_per_s": round(done / elapsed, 1), "us_per_decision": round(elapsed / done * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="P = D = each size")
    ap.add_argument("--classes", type=int, nargs="+", default=[1, 8], help="compatibility classes (1-8)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per decisions row")
    ap.add_argument("--rounds", type=int, default=5, help="changes per change row (median)")
    ap.add_argument("--out", type=Path, default=RESULTS / "pool.json")
    ap.add_argument("--pool-file", default=None, help="measure this router/pool.py instead of the installed one")
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        for k in args.classes:
            row: dict[str, Any] = {"prefills": n, "decodes": n, "classes": k}
            row.update(one_change(n, k, args.rounds))
            row.update(decisions(n, k, args.seconds))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    cols = list(rows[0])
    print("  ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>18}" for c in cols))
    result = {
        "rows": rows,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "pool_file": args.pool_file or "router/pool.py",
        "load_avg": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure layer-wise loading (not a test; `docs/TRANSFER.md` "Layer-wise" quotes its output).

Two worker halves in one process pull a synchronous load over a real transport (NIXL over UCX on loopback,
or Mooncake over TCP), KV shaped like Qwen2.5-0.5B (24 layers, 2 KV heads of 64, bf16, blocks of 32
tokens). The decode's forward after a synchronous load computes one token; each layer's compute is stood in
for by a real one-token MLP of that model's size (`--compute-ms` scales it), run between the layer waits
in vLLM's order. Reported per prompt length, median of `--reps`:

* whole: the step's wait for the whole pull (what `start_load_kv` blocks today), and the compute after it;
* layer-wise: `start_load_kv`, then the time `wait_for_layer_load` blocked per layer (layer 0, the rest);
* hidden: 1 - (time blocked in all, layer-wise) / (whole pull), the fraction of the transfer hidden;
* step: the step's time (blocked + compute) either way.

    .venv-vllm/bin/python -m tests.unit.connector_vllm.layerwise_measure --transport nixl
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.metadata import RecvPlan, StepMetadata
from pdgate.connector.worker import WorkerHalf

LAYERS, KV_HEADS, HEAD, BLOCK = 24, 2, 64, 32
HIDDEN, INTER = 896, 4864


def caches(num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD)
    buf = (torch.randn if fill else torch.zeros)(LAYERS, *shape, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def transport(kind: str) -> Any:
    if kind == "nixl":
        from pdgate.connector.transport.nixl import NixlTransport

        return NixlTransport(ucx_net_devices="lo")
    from pdgate.connector.transport.mooncake import MooncakeTransport

    return MooncakeTransport()


class Layer:
    """One decoder layer's MLP for one token: the per-layer compute of the forward a synchronous load feeds."""

    def __init__(self, scale: float) -> None:
        self.up = torch.randn(HIDDEN, int(INTER * scale))
        self.down = torch.randn(int(INTER * scale), HIDDEN)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.up) @ self.down


def cfg(min_tokens: float | None) -> ConnectorConfig:
    return ConnectorConfig(
        metaserver_url="http://127.0.0.1:1",
        instance_id="m",
        url="http://127.0.0.1:1",
        model="m",
        role="both",
        layerwise_min_tokens=min_tokens,
        sync_pull_timeout_s=60.0,
    )


def step(d: WorkerHalf, addr: dict[str, Any], n_blocks: int, layers: list[Layer], i: int) -> tuple[float, ...]:
    """One synchronous load and the forward it feeds: (blocked in start_load_kv, blocked per layer..., compute)."""
    ids = tuple(range(n_blocks))
    plan = RecvPlan(f"r{i}", f"t{i}", 9, ids, ids, (addr,), time.time() + 60, sync=True)
    t0 = time.perf_counter()
    d.on_step(StepMetadata(pulls=(plan,)))
    start = time.perf_counter() - t0
    names = list(d._layer_of)
    x = torch.randn(1, HIDDEN)
    waits, compute = [], 0.0
    for name, layer in zip(names, layers, strict=True):
        t = time.perf_counter()
        d.wait_for_layer_load(name)
        c = time.perf_counter()
        waits.append(c - t)
        x = layer(x) / 100
        compute += time.perf_counter() - c
    d.finish_layered()
    (oc,) = d.take_outcomes()
    assert oc.ok, oc
    return (start, *waits, compute)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="nixl", choices=["nixl", "mooncake"])
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compute-scale", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(t) for t in args.tokens.split(",")]
    num_blocks = max(sizes) // BLOCK + 1
    layers = [Layer(args.compute_scale) for _ in range(LAYERS)]
    kept = [caches(num_blocks, fill=True), caches(num_blocks, fill=False), caches(num_blocks, fill=False)]
    p = WorkerHalf(cfg(None), tp_rank=0, transport_factory=lambda: transport(args.transport))
    addr = p.register_kv_caches(kept[0])
    p.on_step(StepMetadata(holds=("held",)))  # a prefill holding KV polls every 0.5 ms (NIXL needs the target to)
    whole = WorkerHalf(cfg(None), tp_rank=0, transport_factory=lambda: transport(args.transport), block_size=BLOCK)
    whole.register_kv_caches(kept[1])
    lw = WorkerHalf(cfg(0), tp_rank=0, transport_factory=lambda: transport(args.transport), block_size=BLOCK)
    lw.register_kv_caches(kept[2])
    kib = LAYERS * KV_HEADS * 2 * HEAD * 2 / 1024
    print(f"{args.transport}: {LAYERS} layers, {kib:.0f} KiB of KV per token; ms, median of {args.reps}")
    print("tokens | whole: pull, compute, step | layer-wise: layer 0, layers 1.., blocked, step | hidden")
    n = 0
    for tokens in sizes:
        rows: dict[str, list[tuple[float, ...]]] = {"whole": [], "lw": []}
        for _ in range(args.reps + 1):  # the first of each is a warm-up (connects, first registration)
            for key, d in (("whole", whole), ("lw", lw)):
                n += 1
                rows[key].append(step(d, addr, tokens // BLOCK, layers, n))
        w = [statistics.median(col) * 1e3 for col in zip(*rows["whole"][1:], strict=True)]
        lwm = [statistics.median(col) * 1e3 for col in zip(*rows["lw"][1:], strict=True)]
        pull, wcompute = w[0] + sum(w[1:-1]), w[-1]
        l0, rest, lcompute = lwm[1], sum(lwm[2:-1]), lwm[-1]
        blocked = lwm[0] + l0 + rest
        for got in (kept[1], kept[2]):
            for name, t in got.items():
                assert torch.equal(
                    t[: tokens // BLOCK].view(torch.int16), kept[0][name][: tokens // BLOCK].view(torch.int16)
                )
        print(
            f"{tokens} | {pull:.2f}, {wcompute:.2f}, {pull + wcompute:.2f} | {l0:.2f}, {rest:.2f} "
            f"({rest / (LAYERS - 1):.3f}/layer), {blocked:.2f}, {blocked + lcompute:.2f} | {1 - blocked / pull:.0%}"
        )
    for w in (p, whole, lw):
        w.close()


if __name__ == "__main__":
    main()

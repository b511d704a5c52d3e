"""Layer-wise loading: a synchronous load pulled one layer at a time, so layer i+1 arrives while layer i computes.

vLLM (v1, CPU and GPU, eager and compiled) calls the connector's `wait_for_layer_load(layer)` before each
layer's attention and `save_kv_layer` after it. A synchronous load (`RecvPlan.sync`) runs in the step that
computes the request's last prompt token, so the worker need not wait for the whole pull in
`start_load_kv`: it waits for the last block only (below), submits one pull per layer, in layer order
(`PullRequest.regions`: that layer's regions), and `wait_for_layer_load(i)` waits only for layer i. The
forward of layer 0 starts once layer 0 landed; the other layers' reads run behind the compute of the layers
before them.

Why a threshold (`layerwise_min_tokens`): each layer is a pull of its own (one more submission, one more
completion to poll per layer), which a short prompt does not earn back; SGLang's layer pipeline was 18 %
slower at 256 tokens and 48-68 % faster from 1K tokens. `docs/TRANSFER.md` ("Layer-wise") has what was
measured here.

The last block goes first, whole (`TAIL`), and `start_load_kv` waits for it: vLLM writes a layer's KV of the
tokens the step computes (`unified_kv_cache_update`, vLLM 0.32) before that layer's attention calls
`wait_for_layer_load`, and a synchronous load's step computes the token right after the loaded ones, which
lands in the last loaded block whenever that block is partial (the router's decode prompt ends with the
prefill's first token, whose KV the prefill never wrote). A read of that block landing after the write put
the prefill's stale slot over the token's fresh KV: `tests/e2e/test_15_layerwise.py` saw the tokens differ
from the single instance's from the fourth on, only when layer 0's read was still in flight as the forward
reached it. Only the other blocks, which the step does not write, go layer by layer.

A layer that fails: its `wait_for_layer_load` returns all the same (the forward cannot be stopped midway),
the other layers' reads still end (a read cannot be cancelled, and nothing may write into the blocks once
the step reported them), and the request's blocks are load errors of that step, with the first failed
layer's typed error as the pull's outcome: exactly what a failed whole-request synchronous pull reports.

This module holds the pieces both threads share: which regions make each layer (`layer_groups`), the
per-layer event the transfer thread hands the model-runner thread (`LayerDone`), and the transfer thread's
tally of one job's layer pulls (`LayerTally`); and what the scheduler half counts of a layer-wise load
(`layer_counts`): the proof, on the stats file and `/metrics`, that a load really went layer by layer in
vLLM's forward (the end-to-end test reads it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdgate.connector.transport.base import KVRegion, PullResult
from pdgate.connector.transport.errors import TransportError

__all__ = ["TAIL", "LayerDone", "LayerTally", "layer_counts", "layer_groups", "part_key", "use_layerwise"]


# The part of a layer-wise load pulled before the forward: its last block, every layer (module doc).
TAIL = -1


def layer_groups(layer_names: Iterable[str], regions: Sequence[KVRegion]) -> dict[str, tuple[int, ...]]:
    """Layer name -> the indexes of its regions, in layer order. A layer is one region (vLLM CPU/GPU) or one
    per tensor of its tuple (`<layer>.<i>`, vllm-ascend); a layer whose tensor another layer registered
    already (shared KV) has none, and is left out: its bytes arrive with that layer."""
    groups: dict[str, tuple[int, ...]] = {}
    for name in layer_names:
        prefix = name + "."
        picked = tuple(
            i
            for i, r in enumerate(regions)
            if r.name == name or (r.name.startswith(prefix) and r.name[len(prefix) :].isdigit())
        )
        if picked:
            groups[name] = picked
    return groups


def use_layerwise(min_tokens: float | None, num_blocks: int, block_size: int | None, num_layers: int) -> bool:
    """Whether a synchronous load of `num_blocks` blocks goes layer by layer: the key is set, the load is at
    least that long (counted in whole blocks), and there is more than one layer to overlap."""
    if min_tokens is None or not block_size or num_layers < 2:
        return False
    return num_blocks * block_size >= min_tokens


def layer_counts(order: Sequence[int]) -> dict[str, int]:
    """The counters (`counters.COUNTERS`) one worker's layer-wise load adds, from the layers the forward
    waited for, in wait order: a healthy load waits once per layer, never for a layer below one it already
    waited for (vLLM runs the layers in order)."""
    behind, highest = 0, -1
    for layer in order:  # one pass: a wait below the highest layer already waited for is out of order
        behind += layer < highest
        highest = max(highest, layer)
    return {"recv_layerwise": 1, "layer_waits": len(order), "layer_waits_out_of_order": behind}


def part_key(key: str, layer: int) -> str:
    """The transport's id for one layer's pull of the job keyed `key`."""
    return f"{key}@L{layer}"


@dataclass(frozen=True)
class LayerDone:
    """Layer `layer` (index into the worker's layer groups) of a request's layer-wise load ended."""

    req_id: str
    transfer_id: str
    layer: int
    ok: bool


class LayerTally:
    """The transfer thread's count of one layer-wise job's pulls, and the result they make together: the
    bytes and the longest time of all, or the error of the lowest failed layer (`TAIL` lowest of all).
    `layers` counts `TAIL` as one."""

    def __init__(self, key: str, layers: int) -> None:
        self._key = key
        self._left = layers
        self._nbytes = 0
        self._elapsed = 0.0
        self._error: tuple[int, TransportError] | None = None

    def add(self, layers: Sequence[int], result: PullResult) -> bool:
        """Count the pull of `layers`; True once every layer's pull ended."""
        self._left -= len(layers)
        self._elapsed = max(self._elapsed, result.elapsed_s)
        if result.ok:
            self._nbytes += result.nbytes
        elif result.error is not None and (self._error is None or min(layers) < self._error[0]):
            self._error = (min(layers), result.error)
        return self._left <= 0

    def result(self) -> PullResult:
        if self._error is not None:
            return PullResult.failure(self._key, self._error[1], elapsed_s=self._elapsed)
        return PullResult.success(self._key, nbytes=self._nbytes, elapsed_s=self._elapsed)

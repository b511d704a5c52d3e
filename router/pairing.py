"""Which prefill's KV a decode can take (pure), and why not when none can.

A decode can use a prefill's KV only when both run the same model with the same block size, KV dtype
and layout, over the same transport, and their tensor-parallel shapes line up: equal TP, unless the
prefill's KV is replicated on every TP rank (MLA), in which case a decode with a smaller TP may pull
from any rank; transports that map one decode rank onto one prefill rank (llm_datadist) also need
P tp >= D tp then. A field an instance does not state (a static instance's block size) is a wildcard.

Mismatched pairs are refused before dispatch: elsewhere they produce garbled output or hangs (DP/TP
mismatches in vllm-ascend #16144, sglang #15674), so the client gets `pd_no_compatible_pair` and a
sentence naming the instances and the field that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdgate.metaserver.models import Instance, Role, TransportKind

__all__ = ["TP_GE_TRANSPORTS", "InstanceView", "explain", "incompatibility"]

# Transports whose decode ranks each pull from one prefill rank: P tp >= D tp with replicated KV.
TP_GE_TRANSPORTS: frozenset[TransportKind] = frozenset({TransportKind.LLMDATADIST})


@dataclass(frozen=True)
class InstanceView:
    """What the router knows about one instance (one DP rank of an engine). None means "not stated":
    a wildcard for pairing. Frozen: a refresh replaces views, never edits them."""

    id: str
    role: Role
    url: str
    model: str | None
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    kv_layout: str | None = None
    kv_replicated: bool = False
    transport: TransportKind | None = None
    draining: bool = False
    static: bool = False
    reported: int = 0  # running + waiting, from the registry's load figures
    kv_usage: float = 0.0

    @classmethod
    def from_instance(cls, inst: Instance) -> InstanceView:
        return cls(
            id=inst.id,
            role=inst.role,
            url=inst.url,
            model=inst.model,
            dp_rank=inst.dp_rank,
            dp_size=inst.dp_size,
            tp_size=inst.tp_size,
            block_size=inst.block_size,
            kv_dtype=inst.kv_dtype,
            kv_layout=inst.kv_layout,
            kv_replicated=inst.kv_replicated,
            transport=inst.transport,
            draining=inst.state.value == "draining",
            reported=inst.load.running + inst.load.waiting,
            kv_usage=inst.load.kv_usage,
        )

    @property
    def compat_key(self) -> tuple[object, ...]:
        return (
            self.model,
            self.tp_size,
            self.block_size,
            self.kv_dtype,
            self.kv_layout,
            self.kv_replicated,
            self.transport,
        )


def _differs(a: object, b: object) -> bool:
    return a is not None and b is not None and a != b


def incompatibility(p: InstanceView, d: InstanceView) -> str | None:
    """None when decode `d` can take prefill `p`'s KV, else a short reason naming both values."""
    if _differs(p.model, d.model):
        return f"{d.id} serves model {d.model}, {p.id} serves {p.model}"
    if _differs(p.block_size, d.block_size):
        return f"{d.id} has block_size {d.block_size}, {p.id} has {p.block_size}"
    if _differs(p.kv_dtype, d.kv_dtype):
        return f"{d.id} has kv_dtype {d.kv_dtype}, {p.id} has {p.kv_dtype}"
    if _differs(p.kv_layout, d.kv_layout):
        return f"{d.id} has kv_layout {d.kv_layout!r}, {p.id} has {p.kv_layout!r}"
    if _differs(p.transport, d.transport):
        assert p.transport is not None and d.transport is not None
        return f"{d.id} uses transport {d.transport.value}, {p.id} uses {p.transport.value}"
    if p.tp_size is not None and d.tp_size is not None:
        if p.kv_replicated:
            if p.transport in TP_GE_TRANSPORTS and p.tp_size < d.tp_size:
                return f"{d.id} has tp {d.tp_size} > {p.id}'s tp {p.tp_size} ({p.transport.value} needs P tp >= D tp)"
        elif p.tp_size != d.tp_size:
            return f"{d.id} has tp {d.tp_size}, {p.id} has tp {p.tp_size} and its KV is not replicated"
    return None


def explain(
    model: str,
    prefills: Sequence[InstanceView],
    decodes: Sequence[InstanceView],
    unavailable: Iterable[tuple[InstanceView, str]] = (),
    limit: int = 4,
) -> str:
    """A sentence saying why no prefill/decode pair can serve `model` (for the error and /health)."""
    down = {v.id: why for v, why in unavailable}
    p_model = [p for p in prefills if p.model in (model, None)]
    d_model = [d for d in decodes if d.model in (model, None)]
    if not p_model and not d_model:
        return f"no prefill or decode instance serves model {model}"
    if not p_model:
        return f"no prefill instance serves model {model} (decode: {_ids(d_model, limit)})"
    if not d_model:
        return f"no decode instance serves model {model} (prefill: {_ids(p_model, limit)})"
    reasons: list[str] = []
    for p in p_model:
        for d in d_model:
            why = incompatibility(p, d)
            if why is None:
                why = next((f"{v} {down[v]}" for v in (p.id, d.id) if v in down), None)
                if why is None:
                    continue
            if why not in reasons:
                reasons.append(why)
    if not reasons:
        return f"no available prefill/decode pair for model {model}"
    more = f"; and {len(reasons) - limit} more" if len(reasons) > limit else ""
    return f"no compatible prefill/decode pair for model {model}: " + "; ".join(reasons[:limit]) + more


def _ids(views: Sequence[InstanceView], limit: int) -> str:
    ids = [v.id for v in views[:limit]]
    return ", ".join(ids) + (f" and {len(views) - limit} more" if len(views) > limit else "")

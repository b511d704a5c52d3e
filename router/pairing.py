"""Which prefill's KV a decode can take, and why not when none can (pure).

The rule itself (model, block size, KV dtype and layout, transport, tensor-parallel shapes) lives in
`pdgate.contract`, which the connector applies again before it pulls; this module applies it to
the router's view of its instances and turns refusals into the sentence the client gets with
`pd_no_compatible_pair`, naming the instances and the field that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdgate.contract import mismatch
from pdgate.models import Instance, Role, TransportKind

__all__ = ["InstanceView", "compatible", "explain", "incompatibility"]


@dataclass(frozen=True)
class InstanceView:
    """What the router knows about one instance (one DP rank of an engine). None means "not stated":
    a wildcard for pairing. A `pdgate.contract.KVShape`. Frozen: a refresh replaces views,
    never edits them."""

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
    reported_at: float = 0.0  # the heartbeat that carried them (metaserver clock): which report this is
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
            reported_at=inst.last_heartbeat,
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


def compatible(p: InstanceView, d: InstanceView) -> bool:
    """Whether decode `d` can take prefill `p`'s KV (no sentence built: for filtering a whole pool)."""
    return mismatch(p, d) is None


def incompatibility(p: InstanceView, d: InstanceView) -> str | None:
    """None when decode `d` can take prefill `p`'s KV, else a short reason naming both values."""
    found = mismatch(p, d)
    return None if found is None else found.describe(p.id, d.id)


def explain(
    model: str,
    prefills: Sequence[InstanceView],
    decodes: Sequence[InstanceView],
    unavailable: Iterable[tuple[InstanceView, str]] = (),
    limit: int = 4,
    budget: int = 20_000,
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
    # Bounded: this runs on an error answer and on /health, and a pool of 1,000 x 1,000 has a million
    # pairs. It stops at the first reason past `limit` (then there are "more") or after `budget` pairs.
    reasons: list[str] = []
    seen = 0
    for p in p_model:
        for d in d_model:
            seen += 1
            why = incompatibility(p, d)
            if why is None:
                why = next((f"{v} {down[v]}" for v in (p.id, d.id) if v in down), None)
                if why is None:
                    continue
            if why not in reasons:
                reasons.append(why)
            if len(reasons) > limit or seen >= budget:
                break
        if len(reasons) > limit or seen >= budget:
            break
    if not reasons:
        return f"no available prefill/decode pair for model {model}"
    more = "; and more" if len(reasons) > limit else ""
    return f"no compatible prefill/decode pair for model {model}: " + "; ".join(reasons[:limit]) + more


def _ids(views: Sequence[InstanceView], limit: int) -> str:
    ids = [v.id for v in views[:limit]]
    return ", ".join(ids) + (f" and {len(views) - limit} more" if len(views) > limit else "")

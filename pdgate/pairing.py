"""The prefill/decode pairing rule: which prefill's KV a decode can take.

The router, the connector and the simulator must agree on it, so it is held here once (`pdgate.contract`
re-exports it beside the `kv_transfer_params` type, which carries the KV this rule is about).

The compatibility rule (`mismatch`, `tp_mismatch`, `source_rank`). A decode can take a prefill's KV when both
run the same model with the same block size, KV dtype and KV layout, over the same transport, and their
tensor-parallel (TP) shapes line up:

* Equal TP: decode rank r reads prefill rank r (each rank holds the same heads).
* Unequal TP needs KV replicated on every TP rank (MLA models). Every prefill rank then holds all of it, so
  decode rank r reads prefill rank `r * P_tp // D_tp`, whichever side is larger: a larger prefill spreads
  the decode ranks over its ranks, a larger decode lets several of its ranks read one prefill rank, which a
  one-sided read (NIXL) allows.
* Transports in `TP_GE_TRANSPORTS` (llm_datadist) link each decode rank to a prefill rank of its own, so
  with them the prefill's TP must also be at least the decode's.
* Sharded (GQA) KV with unequal TP: one TP a multiple of the other and the KV heads split whole over both
  (`hetero_tp_fits`), over a transport in `SUB_BLOCK_TRANSPORTS`: each decode rank reads each of its heads,
  a byte range of a block, from a prefill rank holding it (`head_reads`). The KV head count comes from the
  `kv_layout` tags (`layout_kv_heads`): they differ only in the heads per rank, which tells the total.

A field one side does not state (None) matches anything: a static instance tells the router little. The
router applies the rule to pick a pair; the decode applies it again to the location it is about to pull
from, so a pair the router let through (it could not see a field) fails before a byte moves, with the same
sentence. Mismatched pairs are refused before dispatch because elsewhere they produce garbled output or
hangs (DP/TP mismatches in vllm-ascend #16144, sglang #15674).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from pdgate.models import TransportKind

__all__ = [
    "SUB_BLOCK_TRANSPORTS",
    "TALKS_TO",
    "TP_GE_TRANSPORTS",
    "HeadRead",
    "KVFacts",
    "KVShape",
    "Mismatch",
    "head_reads",
    "hetero_tp_fits",
    "layout_kv_heads",
    "mismatch",
    "rank_heads",
    "source_rank",
    "total_kv_heads",
    "tp_mismatch",
    "transports_talk",
]

# Which prefill transports a decode's transport can pull from. Each engine speaks only its own wire protocol
# (NIXL's UCX, Mooncake's transfer engine and llm_datadist's HCCS links cannot read each other's memory, even
# on one host), so every kind talks only to itself: mooncake only with mooncake. Mooncake's protocol (tcp,
# rdma, ascend) is a setting of the connector, checked by the transport itself before a byte moves.
TALKS_TO: dict[TransportKind, frozenset[TransportKind]] = {kind: frozenset({kind}) for kind in TransportKind}


def transports_talk(prefill: TransportKind, decode: TransportKind) -> bool:
    """Whether a decode on transport `decode` can pull a prefill's KV held behind transport `prefill`."""
    return prefill in TALKS_TO.get(decode, frozenset())


# Transports whose decode ranks each link to one prefill rank of their own: they need P tp >= D tp.
TP_GE_TRANSPORTS: frozenset[TransportKind] = frozenset({TransportKind.LLMDATADIST})

# Transports that execute the sub-block reads of sharded unequal TP: the pull's `PullRequest.ranges`
# (connector/transport/base.py; the adapter class says so with `sub_block = True`, which a test checks
# against this set). The NIXL and Mooncake engines can read any byte range, but their adapters, the transfer
# thread (one peer per job), `RecvPlan` (one source per decode rank) and `connector.blocks.tp_sources` still
# pull whole blocks from one peer, so none is listed yet: a pair admitted before its reads run would fail
# every request the router sends it. llm_datadist's `pull_blocks` copies whole blocks of equal size only
# (no offsets in its CacheManager API), so it stays out.
SUB_BLOCK_TRANSPORTS: frozenset[TransportKind] = frozenset()


class KVShape(Protocol):
    """What the rule compares about one side. None: not stated, matches anything.

    `kv_replicated` is a property of the model (MLA); the rule reads the prefill's, the side whose every
    rank must hold all of the KV. The router's `InstanceView` is a `KVShape`; the connector builds `KVFacts`.
    """

    @property
    def model(self) -> str | None: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def kv_dtype(self) -> str | None: ...
    @property
    def kv_layout(self) -> str | None: ...
    @property
    def transport(self) -> TransportKind | None: ...
    @property
    def tp_size(self) -> int | None: ...
    @property
    def kv_replicated(self) -> bool: ...


@dataclass(frozen=True)
class KVFacts:
    """A `KVShape` assembled from parts (a ledger location on one side, an engine's facts on the other)."""

    model: str | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    kv_layout: str | None = None
    transport: TransportKind | None = None
    tp_size: int | None = None
    kv_replicated: bool = False


class Mismatch(NamedTuple):
    """Why a decode cannot take a prefill's KV: the field that differs and both values.

    A named tuple: the router builds one for every refused pair of its pool, so it must be cheap."""

    field: str  # model | block_size | kv_dtype | kv_layout | transport | tp_size
    prefill: Any
    decode: Any
    transport: TransportKind | None = None  # set when the transport is what forbids the TP pair
    reason: str | None = None  # why sharded KV cannot be re-cut over the two TPs (`tp_mismatch`)

    def describe(self, prefill: str = "the prefill", decode: str = "the decode") -> str:
        """One sentence naming both sides (instance ids in the router, roles in the connector)."""
        p, d = self.prefill, self.decode
        if self.field == "model":
            return f"{decode} serves model {d}, {prefill} serves {p}"
        if self.field == "kv_layout":
            return f"{decode} has kv_layout {d!r}, {prefill} has {p!r}"
        if self.field == "transport":
            return f"{decode} uses transport {_name(d)}, {prefill} uses {_name(p)}"
        if self.field == "tp_size":
            if self.reason is not None:
                return f"{decode} has tp {d}, {prefill} has tp {p} and its KV is not replicated: {self.reason}"
            if self.transport is not None:
                return f"{decode} has tp {d} > {prefill}'s tp {p} ({self.transport.value} needs P tp >= D tp)"
            return f"{decode} has tp {d}, {prefill} has tp {p} and its KV is not replicated"
        return f"{decode} has {self.field} {d}, {prefill} has {p}"


def _name(value: Any) -> str:
    return str(value.value) if isinstance(value, TransportKind) else str(value)


def mismatch(p: KVShape, d: KVShape) -> Mismatch | None:
    """None when decode `d` can take prefill `p`'s KV, else the first field that differs."""
    # Written out field by field: the router evaluates this for every prefill/decode pair of its pool.
    a: Any
    b: Any
    a, b = p.model, d.model
    if a is not None and b is not None and a != b:
        return Mismatch("model", a, b)
    a, b = p.block_size, d.block_size
    if a is not None and b is not None and a != b:
        return Mismatch("block_size", a, b)
    a, b = p.kv_dtype, d.kv_dtype
    if a is not None and b is not None and a != b:
        return Mismatch("kv_dtype", a, b)
    a, b = p.kv_layout, d.kv_layout
    if a is not None and b is not None and a != b and not _differ_in_heads_only(a, b, p.tp_size, d.tp_size):
        return Mismatch("kv_layout", a, b)
    a, b = p.transport, d.transport
    if a is not None and b is not None and not transports_talk(a, b):
        return Mismatch("transport", a, b)
    a, b = p.tp_size, d.tp_size
    if a is None or b is None or a == b:
        return None
    heads = None if p.kv_replicated else total_kv_heads(p.kv_layout, a, d.kv_layout, b)
    return tp_mismatch(a, b, kv_replicated=p.kv_replicated, transport=p.transport or d.transport, kv_heads=heads)


def tp_mismatch(
    prefill_tp: int,
    decode_tp: int,
    *,
    kv_replicated: bool,
    transport: TransportKind | None,
    kv_heads: int | None = None,
) -> Mismatch | None:
    """The TP part of the rule (see the module docstring): None when every decode rank has a source.

    `kv_heads`: the model's total KV head count (`total_kv_heads`), needed for sharded KV with unequal TP."""
    if prefill_tp == decode_tp:
        return None
    if kv_replicated:
        if prefill_tp < decode_tp and transport in TP_GE_TRANSPORTS:
            return Mismatch("tp_size", prefill_tp, decode_tp, transport=transport)
        return None
    if kv_heads is None:
        return Mismatch("tp_size", prefill_tp, decode_tp)
    if not hetero_tp_fits(prefill_tp, decode_tp, kv_heads):
        why = f"its {kv_heads} KV heads cannot be re-cut whole (one TP must be a multiple of the other)"
        return Mismatch("tp_size", prefill_tp, decode_tp, reason=why)
    if transport not in SUB_BLOCK_TRANSPORTS:
        name = "an unstated transport" if transport is None else transport.value
        why = f"re-cutting its KV heads needs sub-block reads, which {name} does not run here"
        return Mismatch("tp_size", prefill_tp, decode_tp, transport=transport, reason=why)
    return None


def source_rank(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The prefill TP rank that decode rank `decode_rank` reads, for a pair `tp_mismatch` accepted."""
    return decode_rank * prefill_tp // decode_tp


# ---- Heterogeneous TP over sharded (GQA) KV: which rank holds which heads, what a decode rank reads ----------
#
# `tp_mismatch` admits such a pair over `SUB_BLOCK_TRANSPORTS`; `connector.blocks.hetero_reads` turns the
# per-block `head_reads` below into the byte ranges a decode rank pulls.
#
# vLLM shards KV heads over TP ranks in order: with H KV heads and tp ranks, rank r holds heads
# [r*H/tp, (r+1)*H/tp) when tp divides H, and when H < tp (tp a multiple of H) each head is replicated on tp/H
# ranks, rank r holding head r*H//tp. A block whose heads are its outermost dimension (vLLM CPU's
# `[blocks, heads, block_size, ...]`, HND on GPU) keeps each head as one contiguous run of `head_bytes`,
# so a decode rank reads its heads as byte ranges of the prefill ranks' blocks.


class HeadRead(NamedTuple):
    """Bytes `[src_offset, src_offset + nbytes)` of a prefill rank's block go to `dst_offset` of the decode
    rank's block (offsets within one block of one region)."""

    prefill_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


def rank_heads(rank: int, kv_heads: int, tp: int) -> range:
    """The KV heads TP rank `rank` of `tp` holds (see above); ValueError for a split vLLM refuses."""
    if not 0 <= rank < tp or kv_heads < 1:
        raise ValueError(f"rank {rank} of tp {tp} with {kv_heads} KV heads")
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % kv_heads == 0:
        head = rank * kv_heads // tp
        return range(head, head + 1)
    raise ValueError(f"{kv_heads} KV heads cannot be split over tp {tp} (neither divides the other)")


def hetero_tp_fits(prefill_tp: int, decode_tp: int, kv_heads: int) -> bool:
    """Whether every decode rank finds each of its heads whole on some prefill rank, with one TP a multiple of
    the other: P tp > D tp with P % D == 0 (vllm-ascend's rule; a decode rank gathers P/D prefill ranks), or
    D tp > P tp with D % P == 0 (a decode rank reads part of one prefill rank), for head counts vLLM can split."""
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        return False
    try:
        rank_heads(0, kv_heads, prefill_tp)
        rank_heads(0, kv_heads, decode_tp)
    except ValueError:
        return False
    return True


def head_reads(decode_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int, head_bytes: int) -> list[HeadRead]:
    """What decode rank `decode_rank` reads from which prefill rank, per block, for a pair `hetero_tp_fits`
    accepts: each of its heads from the first prefill rank holding it, runs of adjacent heads merged."""
    if not hetero_tp_fits(prefill_tp, decode_tp, kv_heads):
        raise ValueError(f"tp {prefill_tp} -> {decode_tp} with {kv_heads} KV heads does not fit")
    mine = rank_heads(decode_rank, kv_heads, decode_tp)
    holder: dict[int, int] = {}
    for p in reversed(range(prefill_tp)):  # reversed: the first rank holding a head wins
        for h in rank_heads(p, kv_heads, prefill_tp):
            holder[h] = p
    reads: list[HeadRead] = []
    for i, h in enumerate(mine):
        p = holder[h]
        src = (h - rank_heads(p, kv_heads, prefill_tp).start) * head_bytes
        last = reads[-1] if reads else None
        if last is not None and last.prefill_rank == p and last.src_offset + last.nbytes == src:
            reads[-1] = last._replace(nbytes=last.nbytes + head_bytes)
        else:
            reads.append(HeadRead(p, src, i * head_bytes, head_bytes))
    return reads


# ---- The KV head count, read from the `kv_layout` tags --------------------------------------------------------
#
# The connector's tag (`pdgate.connector.registration.kv_layout_tag`, `layout/dtype/L../H<n>/D../B..`) names
# the KV heads *per rank*: vLLM gives each of tp ranks max(1, H // tp) of a model's H heads. Two ranks of one
# model at unequal TP thus have tags that differ in `H<n>` only, and together they tell H (`total_kv_heads`).


def layout_kv_heads(tag: str | None) -> tuple[str, int] | None:
    """(the tag with its head count blanked, the KV heads per rank), or None for a tag without exactly one
    `/H<n>/` part (a layout string the connector did not write: compared whole, as before)."""
    if tag is None:
        return None
    parts = tag.split("/")
    found = [i for i, part in enumerate(parts) if part[:1] == "H" and part[1:].isdigit() and 0 < i < len(parts) - 1]
    if len(found) != 1:
        return None
    i = found[0]
    heads = int(parts[i][1:])
    if heads < 1:
        return None
    return "/".join([*parts[:i], "H", *parts[i + 1 :]]), heads


def _differ_in_heads_only(p: str, d: str, p_tp: int | None, d_tp: int | None) -> bool:
    """Whether two unequal tags are one model's at unequal TP (see above), not two layouts."""
    if p_tp is None or d_tp is None or p_tp == d_tp:
        return False
    pp, dd = layout_kv_heads(p), layout_kv_heads(d)
    return pp is not None and dd is not None and pp[0] == dd[0]


def total_kv_heads(p_layout: str | None, p_tp: int, d_layout: str | None, d_tp: int) -> int | None:
    """The model's KV head count H from both sides' tags and TPs, or None when they cannot tell it.

    A side knows H exactly when its ranks hold more than one head or its TP is 1 (H = heads * tp); with one
    head per rank on both sides at TP > 1 the heads may be replicated, and H stays unknown. The H found must
    also give each side the heads per rank its tag states."""
    pp, dd = layout_kv_heads(p_layout), layout_kv_heads(d_layout)
    if pp is None or dd is None or pp[0] != dd[0]:
        return None
    sides = ((pp[1], p_tp), (dd[1], d_tp))
    exact = {h * tp for h, tp in sides if h > 1 or tp == 1}
    if len(exact) != 1:
        return None
    heads = exact.pop()
    for h, tp in sides:
        try:
            if len(rank_heads(0, heads, tp)) != h:
                return None
        except ValueError:
            return None
    return heads

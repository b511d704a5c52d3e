"""The transport seam: how a decode worker pulls KV blocks out of a prefill worker's memory.

Every engine we support (NIXL, llm_datadist, and the other pull engines we looked at: Mooncake's
transfer engine, UCX directly) reduces to the same four steps: register memory, export an opaque
peer description, pull a list of (remote block, local block) pairs, learn when it finished.
This module fixes that shape once so the worker half of the connector never imports an
engine, and tests can swap in a fake.

Threading contract: a transport instance is owned by ONE thread (the worker's background
thread). NIXL is not thread-safe and llm_datadist serialises link calls, so no method here
may be called concurrently. Engines that block (llm_datadist) run their own worker thread
internally and still honour this contract at the surface.

Error contract: ``start_pull`` raises synchronously only for requests that can never succeed
(:class:`InvalidPull`) or when the transport is closed (:class:`TransportClosed`). Everything
that happens on the wire (timeouts, dead peers, broken links) comes back from :meth:`poll`
as a failed :class:`PullResult` carrying a typed :class:`TransportError` (a InvalidPull can
arrive that way too when only the engine could tell). A failed pull may have written part of
its destination blocks; they stay owned by the request until the ledger finishes it.

The exception tree (``code`` from :class:`pdgate.errors.Code`) is drawn at the top of ``errors.py``.
"""

from __future__ import annotations

import abc
import logging
import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pdgate.connector.transport.errors import InvalidPull, RegistrationError, TransportClosed, TransportError
from pdgate.connector.transport.ranges import check_ranges

logger = logging.getLogger(__name__)

__all__ = [
    "UINT64_MAX",
    "BlockRun",
    "ByteRange",
    "KVRegion",
    "PullRequest",
    "PullResult",
    "RemotePeer",
    "Transport",
    "byte_ranges",
    "check_layouts_match",
    "check_pull",
    "check_pull_against",
    "coalesce",
    "merge_extents",
    "regions_from_address",
    "regions_to_address",
]

#: kv_key is the ledger's numeric key; llm_datadist ids are uint64, so that is the range we accept.
UINT64_MAX = 2**64 - 1

#: The remote rank's transport address exactly as it registered it (``Transport.local_address()``
#: of the peer). Kind-specific; each transport documents its own keys.
RemotePeer = Mapping[str, Any]


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    # bool is an int subclass; a True block id is always a bug.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class KVRegion:
    """One registered KV tensor (typically one per layer, or one per K and per V).

    Block ``i`` occupies ``block_len`` bytes at ``base_ptr + i * stride``. ``stride`` may exceed
    ``block_len`` for interleaved layouts; transports treat each block as opaque bytes, so any
    dtype works.
    """

    name: str
    base_ptr: int
    block_len: int
    num_blocks: int
    stride: int

    def __post_init__(self) -> None:
        where = f"region {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise RegistrationError("region name must be a non-empty string")
        for attr in ("base_ptr", "block_len", "num_blocks", "stride"):
            value = getattr(self, attr)
            if not _is_int(value) or value <= 0:
                raise RegistrationError(f"{where}: {attr} must be a positive int, got {value!r}")
        if self.stride < self.block_len:
            raise RegistrationError(
                f"{where}: stride {self.stride} is smaller than block_len {self.block_len}; blocks would overlap"
            )

    @classmethod
    def dense(cls, name: str, base_ptr: int, block_len: int, num_blocks: int) -> KVRegion:
        """A region whose blocks are back to back (stride == block_len), the common case."""
        return cls(name, base_ptr, block_len, num_blocks, block_len)

    @property
    def is_dense(self) -> bool:
        return self.stride == self.block_len

    @property
    def extent(self) -> int:
        """Bytes from ``base_ptr`` to the end of the last block: what must be registered."""
        return (self.num_blocks - 1) * self.stride + self.block_len

    def block_addr(self, block_id: int) -> int:
        return self.base_ptr + block_id * self.stride

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "base_ptr": self.base_ptr,
            "block_len": self.block_len,
            "num_blocks": self.num_blocks,
            "stride": self.stride,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVRegion:
        try:
            return cls(
                name=data["name"],
                base_ptr=data["base_ptr"],
                block_len=data["block_len"],
                num_blocks=data["num_blocks"],
                stride=data["stride"],
            )
        except KeyError as exc:
            raise InvalidPull(f"remote region description lacks {exc.args[0]!r}") from None
        except RegistrationError as exc:
            raise InvalidPull(f"remote region description is invalid: {exc.message}") from None


def regions_to_address(regions: Sequence[KVRegion]) -> list[dict[str, Any]]:
    """The JSON form of a region list, as it travels inside ``local_address()``."""
    return [r.to_dict() for r in regions]


def regions_from_address(peer: RemotePeer) -> list[KVRegion]:
    """Parse the ``regions`` list out of a peer address; InvalidPull if missing or malformed."""
    raw = peer.get("regions")
    if not isinstance(raw, list) or not raw:
        raise InvalidPull("remote address has no 'regions' list")
    return [KVRegion.from_dict(item) for item in raw]


@dataclass(frozen=True)
class PullRequest:
    """Pull ``remote_block_ids[i]`` of the peer into ``local_block_ids[i]``, for every region.

    ``transfer_id`` is the ledger's handoff id (it comes back in :class:`PullResult` and, for
    NIXL, as the notification the prefill side receives). ``kv_key`` is the ledger's numeric
    key; engines that key caches by integer use it as is, never a hash of a string.
    ``timeout_s`` overrides the transport's default deadline for this pull. ``regions``: the indexes
    of the registered regions to pull (None: all of them); a layer-wise load pulls one layer's
    regions per request (``pdgate.connector.layerwise``). ``ranges``: copy exactly these byte ranges (peer
    address -> ours) instead of whole blocks, for KV re-cut over unequal TP (``ranges.py``); the block ids then
    only name the blocks for logs. Only a transport with ``sub_block`` accepts it.
    """

    transfer_id: str
    kv_key: int
    remote: RemotePeer
    remote_block_ids: Sequence[int]
    local_block_ids: Sequence[int]
    timeout_s: float | None = None
    regions: Sequence[int] | None = None
    ranges: Sequence[ByteRange] | None = None

    def __post_init__(self) -> None:
        # Freeze the id lists so a caller mutating its list after start_pull cannot race us.
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        object.__setattr__(self, "local_block_ids", tuple(self.local_block_ids))
        if self.regions is not None:
            object.__setattr__(self, "regions", tuple(self.regions))
        if self.ranges is not None:
            object.__setattr__(self, "ranges", tuple(self.ranges))

    def region_indexes(self, count: int) -> tuple[int, ...]:
        """The indexes of the regions this pull reads, of `count` registered (checked by `check_pull_against`)."""
        return tuple(range(count)) if self.regions is None else tuple(self.regions)


@dataclass(frozen=True)
class PullResult:
    """The outcome of one :class:`PullRequest`; ``error`` is set exactly when ``ok`` is False."""

    transfer_id: str
    ok: bool
    error: TransportError | None = None
    nbytes: int = 0
    elapsed_s: float = 0.0

    @classmethod
    def success(cls, transfer_id: str, *, nbytes: int, elapsed_s: float) -> PullResult:
        return cls(transfer_id, True, None, nbytes, elapsed_s)

    @classmethod
    def failure(cls, transfer_id: str, error: TransportError, *, elapsed_s: float = 0.0) -> PullResult:
        return cls(transfer_id, False, error, 0, elapsed_s)


@dataclass(frozen=True)
class BlockRun:
    """``count`` consecutive blocks starting at ``src_start`` (remote) and ``dst_start`` (local)."""

    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True)
class ByteRange:
    src_addr: int
    dst_addr: int
    nbytes: int


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def check_pull(req: PullRequest, *, local_num_blocks: int, remote_num_blocks: int) -> None:
    """Reject requests that can never succeed, naming the first offending index.

    Rules: ``transfer_id`` non-empty; ``kv_key`` in uint64; both id lists non-empty and of equal
    length; every id an int in range; no local block written twice (two sources racing into one
    destination is always a bookkeeping bug). Repeated remote ids are allowed: reading twice is
    harmless.
    """
    if not isinstance(req.transfer_id, str) or not req.transfer_id:
        raise InvalidPull("transfer_id must be a non-empty string")
    if not _is_int(req.kv_key) or not 0 <= req.kv_key <= UINT64_MAX:
        raise InvalidPull(f"kv_key must be an int in [0, 2**64), got {req.kv_key!r}")
    if req.timeout_s is not None and not req.timeout_s > 0:
        raise InvalidPull(f"timeout_s must be positive, got {req.timeout_s!r}")
    src, dst = req.remote_block_ids, req.local_block_ids
    if len(src) != len(dst):
        raise InvalidPull(
            f"remote_block_ids has {len(src)} ids but local_block_ids has {len(dst)}; "
            "trim the remote list to the local count before pulling"
        )
    if not src:
        raise InvalidPull("empty pull: no block ids given")
    _check_ids("remote_block_ids", src, remote_num_blocks)
    _check_ids("local_block_ids", dst, local_num_blocks)
    if len(set(dst)) != len(dst):
        seen: set[int] = set()
        for i, b in enumerate(dst):
            if b in seen:
                raise InvalidPull(f"local_block_ids[{i}] = {b} appears twice; one destination, two sources")
            seen.add(b)


def _check_ids(label: str, ids: Sequence[int], num_blocks: int) -> None:
    # Fast path for the common, valid case; the loop below only runs to name the first offending index.
    if all(type(b) is int for b in ids) and min(ids) >= 0 and max(ids) < num_blocks:
        return
    for i, b in enumerate(ids):
        if not _is_int(b):
            raise InvalidPull(f"{label}[{i}] = {b!r} is not an int")
        if not 0 <= b < num_blocks:
            raise InvalidPull(f"{label}[{i}] = {b} is out of range [0, {num_blocks})")


def check_layouts_match(local: Sequence[KVRegion], remote: Sequence[KVRegion]) -> None:
    """Both sides must describe the same model: same region count, order and block sizes.

    Names are compared too, so a peer serving another model (or another TP shard layout) fails
    here with a message instead of copying the wrong bytes.
    """
    if len(local) != len(remote):
        raise InvalidPull(f"peer registered {len(remote)} regions, we registered {len(local)}")
    for i, (lr, rr) in enumerate(zip(local, remote, strict=True)):
        if lr.name != rr.name or lr.block_len != rr.block_len:
            raise InvalidPull(
                f"region {i} differs: local {lr.name!r}/{lr.block_len} B, remote {rr.name!r}/{rr.block_len} B"
            )


def check_pull_against(req: PullRequest, local: Sequence[KVRegion], remote: Sequence[KVRegion]) -> None:
    """Every transport's pre-flight check of a pull: same layout on both sides, ids in range on each.

    One function so that a new transport cannot forget half of it."""
    check_layouts_match(local, remote)
    if req.regions is not None:
        picked = list(req.regions)
        if not picked or len(set(picked)) != len(picked) or not all(_is_int(i) and 0 <= i < len(local) for i in picked):
            raise InvalidPull(f"regions {picked} must be distinct indexes in [0, {len(local)})")
    check_pull(
        req,
        local_num_blocks=min(r.num_blocks for r in local),
        remote_num_blocks=min(r.num_blocks for r in remote),
    )


def merge_extents(regions: Sequence[KVRegion]) -> list[tuple[int, int]]:
    """Union of the regions' byte extents as (start, length), in address order.

    What an engine registers: vLLM allocates every layer's KV back to back, so the whole cache is one
    extent and one registration; regions with gaps between them stay separate; overlapping K/V views of
    one buffer are registered once (Mooncake refuses overlapping registrations)."""
    spans = sorted((r.base_ptr, r.base_ptr + r.extent) for r in regions)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    """Merge pairs that are adjacent on BOTH sides into runs, keeping the request's order.

    ``[(4,10), (5,11), (6,12), (9,2)]`` becomes ``[BlockRun(4,10,3), BlockRun(9,2,1)]``. Engines
    that move byte ranges (Mooncake-style batches, memcpy) submit one entry per run instead of
    one per block; a per-batch cap then applies to runs, not blocks. NIXL does the same merge
    itself inside ``make_prepped_xfer`` (checked via its telemetry), so its adapter submits
    block ids and only uses the run count for logging.
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidPull(f"coalesce: {len(src_ids)} source ids vs {len(dst_ids)} destination ids")
    runs: list[BlockRun] = []
    if not src_ids:
        return runs
    start_s, start_d, count = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:], strict=True):
        if s == start_s + count and d == start_d + count:
            count += 1
            continue
        runs.append(BlockRun(start_s, start_d, count))
        start_s, start_d, count = s, d, 1
    runs.append(BlockRun(start_s, start_d, count))
    return runs


def byte_ranges(runs: Sequence[BlockRun], src: KVRegion, dst: KVRegion) -> list[ByteRange]:
    """Turn block runs into (src address, dst address, length) for one region pair.

    A run stays one range only when both regions are dense (stride == block_len); otherwise the
    blocks of a run are not contiguous in memory and each becomes its own range.
    """
    if src.block_len != dst.block_len:
        raise InvalidPull(f"block_len differs: remote {src.block_len} B, local {dst.block_len} B")
    out: list[ByteRange] = []
    bl = src.block_len
    if src.is_dense and dst.is_dense:
        for r in runs:
            out.append(ByteRange(src.block_addr(r.src_start), dst.block_addr(r.dst_start), r.count * bl))
        return out
    for r in runs:
        for k in range(r.count):
            out.append(ByteRange(src.block_addr(r.src_start + k), dst.block_addr(r.dst_start + k), bl))
    return out


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


def drain(results: queue.SimpleQueue[PullResult], closed: bool) -> list[PullResult]:
    """The results a transport's own thread queued since the last poll; none once closed (a pull that
    ended while close() waited for it is abandoned, not reported)."""
    out: list[PullResult] = []
    while not closed:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            break
    return out


class Transport(abc.ABC):
    """Pull-mode KV block transport. One instance per worker (per TP rank), one owning thread.

    Lifecycle: construct -> :meth:`register` once -> :meth:`local_address` (publish it) ->
    any number of :meth:`start_pull` / :meth:`poll` -> :meth:`close`. The prefill side never
    pulls, but it must still call :meth:`poll` regularly: engines such as NIXL without a
    progress thread need the target to make progress, and that is where it learns which
    transfers peers finished reading (:meth:`drain_served`).

    What every engine does alike is written here once: the checks a registration and a pull start
    with (:meth:`_check_registration`, :meth:`_admit_pull`), the address's frame (:meth:`local_address`
    around :meth:`_address`) and the idempotent :meth:`close` (around :meth:`_close_engine`). An
    implementation sets ``_regions`` at the end of a successful :meth:`register`.
    """

    kind: ClassVar[str]
    #: Whether :meth:`start_pull` honours ``PullRequest.regions`` (a pull of some regions only, which a
    #: layer-wise load needs); the others pull a request's whole cache at once.
    layerwise: ClassVar[bool] = False
    #: Whether :meth:`start_pull` honours ``PullRequest.ranges`` (``pdgate.pairing.SUB_BLOCK_TRANSPORTS``).
    sub_block: ClassVar[bool] = False
    _regions: tuple[KVRegion, ...] = ()  # registered, in order; empty until register() succeeded
    _closed: bool = False

    @abc.abstractmethod
    def register(self, regions: Sequence[KVRegion]) -> None:
        """Register the KV regions this rank serves and pulls into. Call once, before linking."""

    def local_address(self) -> dict[str, Any]:
        """JSON-serialisable description a peer needs to pull from us: ``kind``, the engine's own keys
        (:meth:`_address`) and the regions. Only after :meth:`register`: the address names the memory."""
        self._ensure_open()
        if not self._regions:
            raise RegistrationError("local_address() before register()")
        return {"kind": self.kind, **self._address(), "regions": regions_to_address(self._regions)}

    @abc.abstractmethod
    def _address(self) -> dict[str, Any]:
        """The engine's own keys of :meth:`local_address` (what its peers link or load us with)."""

    @abc.abstractmethod
    def start_pull(self, req: PullRequest) -> None:
        """Submit one batched pull. Non-blocking; the outcome arrives from :meth:`poll`."""

    @abc.abstractmethod
    def poll(self) -> list[PullResult]:
        """Make progress, enforce deadlines, and return the pulls that finished since last call."""

    def drain_served(self) -> list[str]:
        """Transfer ids peers reported as fully read from us (prefill side may free those blocks).

        Engines without notifications return an empty list; the ledger's READ state then tells
        the prefill side instead.
        """
        return []

    def close(self) -> None:
        """Release engine resources. Idempotent. In-flight pulls are abandoned, not reported."""
        if self._closed:
            return
        self._closed = True
        self._close_engine()

    @abc.abstractmethod
    def _close_engine(self) -> None:
        """What :meth:`close` releases, run once; the transport already counts as closed."""

    # Small shared helpers for implementations -------------------------------------------

    def _label(self) -> str:
        """How errors name this transport (an engine adds its identity: agent name, cluster id)."""
        return f"{self.kind} transport"

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self._label()} is closed")

    def _check_registration(self, regions: Sequence[KVRegion]) -> None:
        """What every :meth:`register` checks first: open, not registered yet, regions given, and
        names unique (a peer's regions are matched to ours by name)."""
        self._ensure_open()
        if self._regions:
            raise RegistrationError(f"register() was already called; {self.kind} regions are registered once")
        if not regions:
            raise RegistrationError("no regions to register")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise RegistrationError(f"duplicate region names in {names}")

    def _admit_pull(self, req: PullRequest) -> list[KVRegion]:
        """What every :meth:`start_pull` checks first (open, registered, a peer of our kind with our
        layout, ids in range: :class:`InvalidPull` or :class:`TransportClosed` otherwise); the peer's regions."""
        self._ensure_open()
        if not self._regions:
            raise InvalidPull("start_pull() before register()")
        self._check_kind(req.remote, self.kind)
        remote = regions_from_address(req.remote)
        if req.ranges is None:
            check_pull_against(req, self._regions, remote)
        elif not self.sub_block:
            raise InvalidPull(f"{self._label()} cannot pull byte ranges (sub-block reads)")
        else:
            check_ranges(req, merge_extents(self._regions), merge_extents(remote))
        return remote

    @staticmethod
    def _check_kind(peer: RemotePeer, kind: str) -> None:
        got = peer.get("kind")
        if got != kind:
            raise InvalidPull(f"peer address is of kind {got!r}, this transport is {kind!r}")

"""Which instance holds which prefix-cache blocks, from the engines' own KV events (pure: no I/O, no clock).

vLLM publishes what its prefix cache holds (`--kv-events-config`, the ZMQ publisher; `kv_events.py`
subscribes): `BlockStored` (hashes of full blocks now cached), `BlockRemoved` (evicted) and
`AllBlocksCleared` (prefix cache reset), in numbered batches. This module keeps, per instance, the set of
block keys it holds, and answers "how many leading blocks of this prompt does instance X hold" for the
prefix-aware policy (`policies/cache_aware.py`) and the decider (`decider.py`).

Keys. vLLM names a block by a chained hash: block i is `H((parent, tuple(tokens of block i), extra))` where
parent is block i-1's hash (the first block's parent is `NONE_HASH = H(seed)`), H is the engine's
`--prefix-caching-hash-algo` (default "sha256": SHA-256 over `pickle.dumps(..., HIGHEST_PROTOCOL)` in
vllm 0.32) and the seed is `PYTHONHASHSEED` when the engine has one, else "vllm-none-hash". Events carry
the 32-byte hash, or its low 64 bits as an int when the engine sets `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`.
The index keeps the low 64 bits either way (`block_key`): 8 bytes instead of 32, the same key in both
modes, and a collision only misroutes a request (the engine checks its own full hashes). `BlockHasher`
computes a prompt's keys the way the engine does, so only full blocks count (vLLM never caches a partial
one); a request with a LoRA, multimodal inputs or a cache_salt hashes with extra keys the router does not
reproduce, so it matches nothing and is routed on load alone (never wrongly, only without the bonus).

Sequence numbers. Each engine (DP rank) numbers its batches 0, 1, 2...; PUB/SUB drops messages when a
subscriber lags (high-water mark) or reconnects, so `apply` checks each batch against the next number it
expects: the next one is applied; a smaller one on the live stream after a larger one is a restarted
engine (its counter started again: its cache is new, the entries are dropped); a smaller one otherwise is
a duplicate (a batch already replayed); a larger one is a gap: nothing is applied, `Outcome.GAP` tells the
caller to replay from `expected(instance)` (vLLM's replay socket) and then offer the batch again; when the
replay cannot fill the hole (`resume`), the instance's entries are dropped and rebuilt from fresh events.
Dropping is always safe: the index then underestimates what an engine holds, which costs a cache hit, never
correctness. An instance that leaves the pool takes its entries with it (`forget`).

Memory bound: an engine never holds more blocks than its KV cache has, so a set past `max_blocks` means
removals were lost; the instance is dropped and rebuilt (`Outcome.OVERFLOW`). The index therefore holds at
most `max_blocks` keys per instance (default 2**20: 16M tokens at block size 16, more than one accelerator's
KV cache holds). Measured (bench/kv_index.py, CPython 3.11; bench/results/kv_index.json): 66-74 MiB per
million blocks held, whatever the number of instances (a set of 64-bit ints; each instance's blocks are
its own entries, so a block cached on two instances counts twice). Hashing a 2,048-token prompt at block
size 16 costs 0.4-0.8 ms (SHA-256 over pickle, as the engine does), so a lookup hashes a prompt's blocks
only as far as some instance holds its prefix (`PromptKeys`), once per request and block size.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_SEED",
    "BlockHasher",
    "Cleared",
    "KVEvent",
    "KVIndex",
    "Outcome",
    "PromptKeys",
    "Removed",
    "Stored",
    "block_key",
]

DEFAULT_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
_MASK64 = (1 << 64) - 1


def block_key(block_hash: bytes | int) -> int:
    """The index's key for an event's block hash: its low 64 bits, as vLLM's int mode publishes them."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash[-8:], "big")


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class BlockHasher:
    """A prompt's block keys as the engine computes them (hash algo "sha256", vllm 0.32's default).

    `seed` is the engine's PYTHONHASHSEED when it sets one, else vLLM's fixed default. Only token-id
    prompts can be hashed: for a text prompt the router does not tokenize (see `kv_events.py`)."""

    __slots__ = ("_none", "block_size")

    def __init__(self, block_size: int, seed: str = DEFAULT_SEED) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._none = _sha256_pickle(seed)

    def keys(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Keys of the prompt's full blocks, first to last (at most `limit` blocks)."""
        return list(itertools.islice(PromptKeys(self, token_ids), limit))


class PromptKeys:
    """A prompt's block keys, hashed only as far as a lookup reads them.

    A lookup stops at the first block an instance lacks (vLLM reuses only a prefix), so the keys past the
    longest prefix any candidate holds are never needed: a prompt no instance holds costs no hash at all,
    one whose first m blocks are held costs m + 1, where hashing every block of a 2,048-token prompt costs
    0.4-0.8 ms of the router's CPU (`BlockHasher.keys`, the same chain). Iterating yields the keys in order,
    hashing each on first use; `len` is the number of full blocks, known without hashing."""

    __slots__ = ("_bs", "_ids", "_keys", "_n", "_parent")

    def __init__(self, hasher: BlockHasher, token_ids: Sequence[int]) -> None:
        self._bs = hasher.block_size
        self._ids = token_ids
        self._n = len(token_ids) // self._bs
        self._parent = hasher._none
        self._keys: list[int] = []

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        i = 0
        while i < self._n:
            if i == len(self._keys):
                bs = self._bs
                self._parent = _sha256_pickle((self._parent, tuple(self._ids[i * bs : (i + 1) * bs]), None))
                self._keys.append(int.from_bytes(self._parent[-8:], "big"))
            yield self._keys[i]
            i += 1

    @property
    def hashed(self) -> int:
        """Blocks hashed so far (what the lookups cost)."""
        return len(self._keys)


@dataclass(frozen=True, slots=True)
class Stored:
    keys: tuple[int, ...]
    block_size: int = 0  # tokens per block, as the engine states it (0: not stated)


@dataclass(frozen=True, slots=True)
class Removed:
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


class Outcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied (a replayed batch seen again): ignored
    GAP = "gap"  # batches missing before this one: not applied; replay from `expected`, then offer it again
    RESTART = "restart"  # the engine's numbering started again: entries dropped, this batch applied
    OVERFLOW = "overflow"  # more blocks than `max_blocks`: removals were lost; entries dropped


class KVIndex:
    """Per-instance sets of held block keys, fed by numbered event batches (see the module docstring)."""

    def __init__(self, max_blocks: int = 1 << 20) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._blocks: dict[str, set[int]] = {}
        self._next: dict[str, int] = {}  # the sequence number expected next
        self._last_live: dict[str, int] = {}  # the last live sequence number seen (restart detection)
        self._block_size: dict[str, int] = {}  # tokens per block, from the engine's BlockStored events

    # -- feeding -----------------------------------------------------------------------------

    def apply(self, instance: str, seq: int, events: Iterable[KVEvent], replayed: bool = False) -> Outcome:
        """Apply batch `seq` of `instance` if it is the next one; see `Outcome` for the others."""
        expected = self._next.get(instance)
        outcome = Outcome.APPLIED
        if not replayed:
            last = self._last_live.get(instance)
            if last is not None and seq <= last:  # a live stream only goes up: the engine restarted
                self.drop(instance)
                expected = None
                outcome = Outcome.RESTART
        if expected is not None and seq < expected:
            if not replayed:
                self._last_live[instance] = seq
            return Outcome.DUPLICATE
        if expected is not None and seq > expected:
            return Outcome.GAP
        if not replayed:
            self._last_live[instance] = seq
        self._next[instance] = seq + 1
        held = self._blocks.setdefault(instance, set())
        for ev in events:
            if isinstance(ev, Stored):
                held.update(ev.keys)
                if ev.block_size:
                    self._block_size[instance] = ev.block_size
            elif isinstance(ev, Removed):
                held.difference_update(ev.keys)
            else:
                held.clear()
        if len(held) > self.max_blocks:
            held.clear()
            return Outcome.OVERFLOW
        return outcome

    def expected(self, instance: str) -> int | None:
        """The sequence number `instance` should send next (None before its first batch)."""
        return self._next.get(instance)

    def resume(self, instance: str, seq: int) -> None:
        """A gap nobody can fill (no replay, or the replay buffer no longer has it): drop the entries and
        accept batch `seq` next; fresh events rebuild what the engine holds."""
        self.drop(instance)
        self._next[instance] = seq

    def drop(self, instance: str) -> None:
        """Forget what `instance` holds but keep following it (resync)."""
        held = self._blocks.get(instance)
        if held is not None:
            held.clear()
        self._next.pop(instance, None)

    def forget(self, instance: str) -> None:
        """`instance` left the pool: its entries and sequence state go with it."""
        self._blocks.pop(instance, None)
        self._next.pop(instance, None)
        self._last_live.pop(instance, None)
        self._block_size.pop(instance, None)

    # -- reading -----------------------------------------------------------------------------

    def matched(self, instance: str, keys: Iterable[int]) -> int:
        """How many leading blocks of `keys` `instance` holds (vLLM reuses only a prefix of blocks); reads
        `keys` only up to the first miss, and not at all for an instance that holds nothing (`PromptKeys`)."""
        held = self._blocks.get(instance)
        if not held:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def block_size(self, instance: str) -> int | None:
        """The block size `instance`'s events stated (None before its first stored block)."""
        return self._block_size.get(instance)

    def size(self, instance: str) -> int:
        held = self._blocks.get(instance)
        return len(held) if held is not None else 0

    def instances(self) -> list[str]:
        return sorted(self._blocks)

    def total(self) -> int:
        return sum(len(s) for s in self._blocks.values())

"""cache_aware: the instance holding the longest cached prefix of the prompt, weighed against its load.

Precise where the engines say what they hold (issue #22 item 4): with `--kv-events` the router follows
each engine's KV events in a `KVIndex` and hashes the prompt's blocks as the engine does
(`kv_index.BlockHasher`), so "instance X holds the first N blocks" is what the engine published, not a
guess. The score is llm-d's prefix + load scoring, each part normalised to 0..1 over the candidates:

    score = prefix_weight * matched_blocks / prompt_blocks + (1 - load / max_load)

so with the default weight 2 a full prefix hit outweighs the difference between an idle and the busiest
candidate, and half a prefix hit equals it; ties go to the rng. A candidate over `load_factor` x (mean
load + 1) is passed over like in prefix_affinity, so a hot prefix spills instead of piling up.

Where it cannot be precise it is today's approximate policy (`prefix_affinity`): events off (no index),
a text or chat prompt (the router does not tokenize: it would need the model's tokenizer and chat template,
and any difference from the engine's makes every lookup miss), or no candidate holding any block yet.

`cached_tokens` gives the decider (`decider.py`) the decode's cached prefix for the same request: the
request's keys are hashed once per block size and reused by both calls, and only as far as some candidate
holds the prefix (`kv_index.PromptKeys`): a prompt no instance holds costs no hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import ClassVar

from pdgate.router.bodies import RequestFacts
from pdgate.router.kv_index import DEFAULT_SEED, BlockHasher, KVIndex, PromptKeys
from pdgate.router.policies import load_of
from pdgate.router.policies.prefix_affinity import PrefixAffinity
from pdgate.router.pool import LiveInstance

__all__ = ["DEFAULT_BLOCK_SIZE", "CacheAware"]

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs, used until an instance's events or registration say


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    OPTIONS: ClassVar[tuple[str, ...]] = ("load_factor", "kv_index", "prefix_weight", "hash_seed")

    def __init__(
        self,
        kv_index: KVIndex | None = None,
        load_factor: float = 1.25,
        prefix_weight: float = 2.0,
        hash_seed: str = DEFAULT_SEED,
    ) -> None:
        if prefix_weight < 0:
            raise ValueError("prefix_weight must be >= 0")
        self.index = kv_index
        self.prefix_weight = prefix_weight
        self.load_factor = load_factor
        self._fallback = PrefixAffinity(load_factor)
        self._seed = hash_seed
        self._hashers: dict[int, BlockHasher] = {}
        self._last: tuple[Sequence[int] | None, int, PromptKeys | None] = (None, 0, None)

    def block_size(self, inst: LiveInstance) -> int:
        """An instance's block size: what its events said, else its registration, else vLLM's default."""
        stated = self.index.block_size(inst.id) if self.index is not None else None
        return stated or inst.view.block_size or DEFAULT_BLOCK_SIZE

    def keys(self, token_ids: Sequence[int], block_size: int) -> PromptKeys:
        """The prompt's block keys at `block_size`, hashed as lookups read them; the last request's are reused
        (policy, then decider)."""
        ids, size, keys = self._last
        if ids is token_ids and size == block_size and keys is not None:
            return keys
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size, self._seed)
        keys = PromptKeys(hasher, token_ids)
        self._last = (token_ids, block_size, keys)
        return keys

    def cached_tokens(self, inst: LiveInstance, req: RequestFacts) -> int:
        """Leading prompt tokens `inst`'s prefix cache holds (0 without events or token ids)."""
        if self.index is None or not req.token_ids or not self.index.size(inst.id):
            return 0
        size = self.block_size(inst)
        return self.index.matched(inst.id, self.keys(req.token_ids, size)) * size

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None:
        n = len(candidates)
        if n <= 1:
            return 0 if n else None
        index = self.index
        if index is None or not req.token_ids or not any(index.size(c.id) for c in candidates):
            return self._fallback.choose(candidates, req, rng)  # a cold index: nothing to weigh, nothing to hash
        fractions: list[float] = []
        for c in candidates:
            keys = self.keys(req.token_ids, self.block_size(c))
            fractions.append(index.matched(c.id, keys) / len(keys) if keys else 0.0)
        if max(fractions) == 0.0:
            return self._fallback.choose(candidates, req, rng)
        loads = [load_of(c) for c in candidates]
        bound = self.load_factor * (sum(loads) / n + 1.0)
        top = max(loads) or 1.0
        best = -1.0
        ties: list[int] = []
        for i in range(n):
            if loads[i] > bound:
                continue
            score = self.prefix_weight * fractions[i] + (1.0 - loads[i] / top)
            if score > best:
                best, ties = score, [i]
            elif score == best:
                ties.append(i)
        return ties[0] if len(ties) == 1 else ties[int(rng.random() * len(ties))]

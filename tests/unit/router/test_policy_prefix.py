"""policies/cache_aware.py: longest cached prefix (from the KV-event index) weighed against load."""

from __future__ import annotations

from random import Random

import pytest
from pdgate.router.bodies import COMPLETIONS, RequestFacts
from pdgate.router.breaker import CircuitBreaker
from pdgate.router.kv_index import BlockHasher, KVIndex, Stored
from pdgate.router.pairing import InstanceView
from pdgate.router.policies import make_policy
from pdgate.router.policies.cache_aware import DEFAULT_BLOCK_SIZE, CacheAware
from pdgate.router.policies.prefix_affinity import PrefixAffinity
from pdgate.router.pool import LiveInstance

from pdgate.models import Role

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4


def inst(name: str, requests: int = 0, block_size: int | None = BS) -> LiveInstance:
    view = InstanceView(name, Role.PREFILL, f"http://{name}:8000", "m", block_size=block_size)
    li = LiveInstance(view, CircuitBreaker())
    li.requests = requests
    return li


def facts(ids: list[int] | None = PROMPT, prefix: bytes = b"text") -> RequestFacts:
    return RequestFacts(COMPLETIONS, "m", False, len(ids or ()), 16, prefix, ids)


def holding(**blocks: int) -> KVIndex:
    """An index where instance `name` holds the first n blocks of PROMPT."""
    idx = KVIndex()
    keys = BlockHasher(BS).keys(PROMPT)
    for name, n in blocks.items():
        idx.apply(name, 0, [Stored(tuple(keys[:n]), block_size=BS)])
    return idx


def test_longest_cached_prefix_wins_at_equal_load() -> None:
    p = CacheAware(holding(a=2, b=6, c=0))
    assert p.choose([inst("a"), inst("b"), inst("c")], facts(), Random(0)) == 1


def test_load_outweighs_a_small_prefix_difference() -> None:
    p = CacheAware(holding(a=3, b=4))
    # b holds one block more (1/8 of the prompt: 0.25 with weight 2) but is the busiest: 1 - 4/4 = 0
    assert p.choose([inst("a", requests=1), inst("b", requests=4)], facts(), Random(0)) == 0
    # a full hit beats the load difference
    p = CacheAware(holding(a=0, b=8))
    assert p.choose([inst("a", requests=1), inst("b", requests=4)], facts(), Random(0)) == 1


def test_an_overloaded_holder_spills() -> None:
    p = CacheAware(holding(a=8), load_factor=1.25)
    cands = [inst("a", requests=20), inst("b"), inst("c")]  # mean 6.67, bound 9.6
    assert p.choose(cands, facts(), Random(0)) in (1, 2)


def test_falls_back_to_prefix_affinity_without_events_text_or_hits() -> None:
    cands = [inst("a"), inst("b"), inst("c")]
    affinity = PrefixAffinity().choose(cands, facts(), Random(0))
    assert CacheAware(None).choose(cands, facts(), Random(0)) == affinity
    assert CacheAware(holding(b=8)).choose(cands, facts(ids=None), Random(0)) == affinity
    assert CacheAware(KVIndex()).choose(cands, facts(), Random(0)) == affinity


def test_a_cold_index_is_not_asked_per_block() -> None:
    # No candidate holds a block (a fresh cluster, or events that have not arrived): the choice is prefix
    # affinity's and the decider's cached length 0 without the prompt's keys being built at all.
    cold = CacheAware(holding(z=8))  # only an instance that is not a candidate holds anything
    cands = [inst("a"), inst("b")]
    assert cold.choose(cands, facts(), Random(0)) == PrefixAffinity().choose(cands, facts(), Random(0))
    assert cold.cached_tokens(inst("a"), facts()) == 0
    assert cold._last == (None, 0, None)


def test_cached_tokens_for_the_decider() -> None:
    p = CacheAware(holding(a=5))
    assert p.cached_tokens(inst("a"), facts()) == 5 * BS
    assert p.cached_tokens(inst("b"), facts()) == 0
    assert p.cached_tokens(inst("a"), facts(ids=None)) == 0
    assert CacheAware(None).cached_tokens(inst("a"), facts()) == 0


def test_block_size_comes_from_events_then_registration_then_default() -> None:
    idx = KVIndex()
    idx.apply("a", 0, [Stored((1,), block_size=32)])
    p = CacheAware(idx)
    assert p.block_size(inst("a", block_size=BS)) == 32
    assert p.block_size(inst("b", block_size=BS)) == BS
    assert p.block_size(inst("c", block_size=None)) == DEFAULT_BLOCK_SIZE


def test_keys_are_hashed_once_per_request_and_block_size() -> None:
    p = CacheAware(holding(a=8))
    req = facts()
    first = p.keys(req.token_ids or [], BS)
    assert p.keys(req.token_ids or [], BS) is first
    assert list(p.keys(req.token_ids or [], 8)) == BlockHasher(8).keys(PROMPT)


def test_registry_and_options() -> None:
    idx = KVIndex()
    p = make_policy("cache_aware", kv_index=idx, load_factor=2.0, prefix_weight=1.0, prefix_chars=9)
    assert isinstance(p, CacheAware) and p.index is idx and p.prefix_weight == 1.0
    with pytest.raises(ValueError):
        CacheAware(prefix_weight=-1)

"""policies/: each policy over plain candidates, with a seeded rng (no sockets, no statistics)."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

import pytest
from pdgate.router.bodies import COMPLETIONS, RequestFacts
from pdgate.router.policies import POLICIES, TOKEN_UNIT, load_of, make_policy
from pdgate.router.policies.least_load import LeastLoad
from pdgate.router.policies.power_of_two import PowerOfTwo
from pdgate.router.policies.prefix_affinity import PrefixAffinity, rank
from pdgate.router.policies.round_robin import RoundRobin


@dataclass
class C:
    id: str
    requests: int = 0
    tokens: int = 0
    others: int = 0


def facts(prefix: bytes = b"") -> RequestFacts:
    return RequestFacts(COMPLETIONS, "m", False, 10, 16, prefix)


def test_registry_names() -> None:
    assert sorted(POLICIES) == ["cache_aware", "least_load", "power_of_two", "prefix_affinity", "round_robin"]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")
    assert isinstance(make_policy("prefix_affinity", load_factor=2.0, unrelated=1), PrefixAffinity)


def test_load_is_own_plus_others_plus_tokens() -> None:
    assert load_of(C("a", requests=2, others=5)) == 7
    assert load_of(C("a", requests=6, others=0, tokens=TOKEN_UNIT)) == 7


def test_empty_and_single() -> None:
    for cls in (RoundRobin, LeastLoad, PowerOfTwo, PrefixAffinity):
        p = cls()
        assert p.choose([], facts(b"x"), Random(0)) is None
        assert p.choose([C("a")], facts(b"x"), Random(0)) == 0


def test_round_robin_cycles() -> None:
    p = RoundRobin()
    cands = [C("a"), C("b"), C("c")]
    assert [p.choose(cands, facts(), Random(0)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_load_picks_the_minimum_and_breaks_ties_by_rng() -> None:
    p = LeastLoad()
    cands = [C("a", requests=3), C("b", requests=1), C("c", others=2)]
    assert p.choose(cands, facts(), Random(0)) == 1
    tied = [C("a", requests=1), C("b", requests=1), C("c", requests=4)]
    seen = {p.choose(tied, facts(), Random(seed)) for seed in range(20)}
    assert seen == {0, 1}
    assert p.choose([C("a", tokens=4 * TOKEN_UNIT), C("b", requests=2)], facts(), Random(0)) == 1


def test_power_of_two_picks_the_less_loaded_of_two_distinct() -> None:
    p = PowerOfTwo()
    cands = [C("a", requests=9), C("b", requests=0)]
    assert all(p.choose(cands, facts(), Random(seed)) == 1 for seed in range(20))
    many = [C(str(i), requests=i) for i in range(5)]
    for seed in range(50):
        i = p.choose(many, facts(), Random(seed))
        assert i is not None and 0 <= i < 5 and i != 4  # the most loaded never beats its rival


def test_prefix_affinity_is_sticky_and_deterministic() -> None:
    p = PrefixAffinity()
    cands = [C(f"p{i}") for i in range(4)]
    first = p.choose(cands, facts(b"shared system prompt"), Random(0))
    assert all(p.choose(cands, facts(b"shared system prompt"), Random(s)) == first for s in range(10))
    picks = {p.choose(cands, facts(f"prompt {i}".encode()), Random(0)) for i in range(40)}
    assert len(picks) > 1  # different prefixes spread


def test_adding_an_instance_moves_only_keys_to_it() -> None:
    ids = [f"p{i}" for i in range(5)]
    keys = [f"prefix-{i}".encode() for i in range(200)]
    before = {k: ids[rank(k, ids)[0]] for k in keys}
    grown = [*ids, "p5"]
    after = {k: grown[rank(k, grown)[0]] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "p5" for k in moved)
    assert 0 < len(moved) < len(keys) // 2


def test_prefix_affinity_spills_over_the_load_bound() -> None:
    p = PrefixAffinity(load_factor=1.25)
    cands = [C("p0"), C("p1"), C("p2")]
    key = b"hot prefix"
    home = p.choose(cands, facts(key), Random(0))
    assert home is not None
    cands[home].requests = 20  # mean 6.7 -> bound 9.6: the home instance is over it
    spill = p.choose(cands, facts(key), Random(0))
    assert spill != home
    assert spill == rank(key, [c.id for c in cands])[1]  # the next in rendezvous order


def test_prefix_affinity_without_prompt_uses_least_load() -> None:
    p = PrefixAffinity()
    assert p.choose([C("a", requests=5), C("b", requests=1)], facts(b""), Random(0)) == 1

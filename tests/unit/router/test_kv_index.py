"""The prefix-cache index (router/kv_index.py): events, sequence gaps, restarts, leaving, the bound."""

from __future__ import annotations

import pytest
from pdgate.router.kv_index import BlockHasher, Cleared, KVIndex, Outcome, PromptKeys, Removed, Stored, block_key


def test_stored_removed_cleared_move_what_an_instance_holds() -> None:
    idx = KVIndex()
    assert idx.apply("p1", 0, [Stored((1, 2, 3))]) is Outcome.APPLIED
    assert idx.matched("p1", [1, 2, 3, 4]) == 3
    assert idx.apply("p1", 1, [Removed((2,))]) is Outcome.APPLIED
    assert idx.matched("p1", [1, 2, 3]) == 1  # only a prefix counts: 3 without 2 is no reuse
    assert idx.apply("p1", 2, [Cleared(), Stored((9,))]) is Outcome.APPLIED
    assert idx.matched("p1", [1]) == 0
    assert idx.matched("p1", [9]) == 1
    assert idx.matched("unknown", [9]) == 0


def test_instances_are_separate() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1, 2))])
    idx.apply("p2", 0, [Stored((1,))])
    assert (idx.matched("p1", [1, 2]), idx.matched("p2", [1, 2])) == (2, 1)
    assert idx.instances() == ["p1", "p2"]
    assert idx.total() == 3


def test_the_block_size_is_the_engines_own() -> None:
    idx = KVIndex()
    assert idx.block_size("p1") is None
    idx.apply("p1", 0, [Stored((1,), block_size=16)])
    idx.apply("p1", 1, [Stored((2,))])  # unstated: kept
    assert idx.block_size("p1") == 16
    idx.forget("p1")
    assert idx.block_size("p1") is None


def test_a_gap_applies_nothing_until_replayed() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1,))])
    assert idx.apply("p1", 3, [Stored((4,))]) is Outcome.GAP
    assert idx.matched("p1", [1, 4]) == 1 and idx.expected("p1") == 1
    # the replay sends 1..3; the live batch 3, offered again, is then a duplicate
    assert idx.apply("p1", 1, [Stored((2,))], replayed=True) is Outcome.APPLIED
    assert idx.apply("p1", 2, [Removed((1,))], replayed=True) is Outcome.APPLIED
    assert idx.apply("p1", 3, [Stored((4,))], replayed=True) is Outcome.APPLIED
    assert idx.apply("p1", 3, [Stored((4,))]) is Outcome.DUPLICATE
    assert idx.apply("p1", 4, [Stored((5,))]) is Outcome.APPLIED
    assert idx.matched("p1", [2, 4, 5]) == 3 and idx.matched("p1", [1]) == 0  # 1 was removed


def test_replay_batches_already_applied_are_duplicates() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1,))])
    idx.apply("p1", 1, [Stored((2,))])
    assert idx.apply("p1", 0, [Cleared()], replayed=True) is Outcome.DUPLICATE
    assert idx.size("p1") == 2


def test_an_unfillable_gap_drops_the_instance_until_fresh_events() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1, 2))])
    assert idx.apply("p1", 7, [Stored((8,))]) is Outcome.GAP
    idx.resume("p1", 7)
    assert idx.size("p1") == 0  # what it held between 1 and 6 is unknown: nothing is claimed
    assert idx.apply("p1", 7, [Stored((8,))]) is Outcome.APPLIED
    assert idx.matched("p1", [8]) == 1


def test_a_restarted_engine_numbering_from_zero_drops_old_entries() -> None:
    idx = KVIndex()
    for seq in range(5):
        idx.apply("p1", seq, [Stored((seq,))])
    assert idx.apply("p1", 0, [Stored((100,))]) is Outcome.RESTART
    assert idx.matched("p1", [0]) == 0 and idx.matched("p1", [100]) == 1
    assert idx.apply("p1", 1, [Stored((101,))]) is Outcome.APPLIED


def test_live_duplicates_after_a_replay_are_not_a_restart() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1,))])
    assert idx.apply("p1", 2, [Stored((3,))]) is Outcome.GAP
    idx.apply("p1", 1, [Stored((2,))], replayed=True)
    idx.apply("p1", 2, [Stored((3,))], replayed=True)
    idx.apply("p1", 3, [Stored((4,))], replayed=True)
    # live messages queued during the replay: 2 (the gap's), then 3, then new ones
    assert idx.apply("p1", 2, [Stored((3,))]) is Outcome.DUPLICATE
    assert idx.apply("p1", 3, [Stored((4,))]) is Outcome.DUPLICATE
    assert idx.apply("p1", 4, [Stored((5,))]) is Outcome.APPLIED
    assert idx.matched("p1", [1, 2, 3, 4, 5]) == 5


def test_an_instance_that_leaves_takes_its_entries() -> None:
    idx = KVIndex()
    idx.apply("p1", 0, [Stored((1,))])
    idx.apply("p2", 0, [Stored((1,))])
    idx.forget("p1")
    assert idx.instances() == ["p2"] and idx.matched("p1", [1]) == 0
    assert idx.expected("p1") is None
    assert idx.apply("p1", 5, [Stored((1,))]) is Outcome.APPLIED  # back: followed afresh


def test_more_blocks_than_the_bound_drops_the_instance() -> None:
    idx = KVIndex(max_blocks=4)
    idx.apply("p1", 0, [Stored((1, 2, 3, 4))])
    assert idx.size("p1") == 4
    assert idx.apply("p1", 1, [Stored((5,))]) is Outcome.OVERFLOW
    assert idx.size("p1") == 0
    assert idx.apply("p1", 2, [Stored((6,))]) is Outcome.APPLIED
    with pytest.raises(ValueError):
        KVIndex(max_blocks=0)


def test_block_key_is_the_same_in_bytes_and_int_modes() -> None:
    h = bytes(range(32))
    as_int = int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash
    assert block_key(h) == block_key(as_int) == as_int


def test_hasher_counts_full_blocks_only_and_chains() -> None:
    hasher = BlockHasher(4)
    a = hasher.keys(list(range(11)))
    assert len(a) == 2
    b = hasher.keys([*range(8), 99, 98, 97])
    assert b == a  # the partial tail does not count
    c = hasher.keys([0, 1, 2, 3, 9, 9, 9, 9])
    assert c[0] == a[0] and c[1] != a[1]
    assert hasher.keys(list(range(40)), limit=3) == hasher.keys(list(range(12)))
    assert BlockHasher(4, seed="other").keys(list(range(4))) != a[:1]


def test_prompt_keys_hash_only_as_far_as_a_lookup_reads() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(42))  # 10 full blocks and 2 tokens that make none
    full = hasher.keys(tokens)
    assert len(full) == 10 and hasher.keys(tokens, limit=3) == full[:3]
    idx = KVIndex()
    idx.apply("held3", 0, [Stored(tuple(full[:3]))])
    idx.apply("other", 0, [Stored((123,))])
    lazy = PromptKeys(hasher, tokens)
    assert len(lazy) == 10 and lazy.hashed == 0  # the block count needs no hash
    assert idx.matched("nobody", lazy) == 0 and lazy.hashed == 0  # an instance that holds nothing: none
    assert idx.matched("other", lazy) == 0 and lazy.hashed == 1  # a miss on the first block: one
    assert idx.matched("held3", lazy) == 3 and lazy.hashed == 4  # 3 held + the first miss
    assert idx.matched("held3", lazy) == 3 and lazy.hashed == 4  # hashed once, read again
    assert list(lazy) == full and lazy.hashed == 10  # the same chain as the engine's (test_kv_index_vllm)

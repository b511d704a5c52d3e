"""Key layout and store selection, without a server: one hash tag for every key, URL handling."""

from __future__ import annotations

import re

import pytest
from pdgate.metaserver.ledger import kv_key_floor
from pdgate.metaserver.store import open_store
from pdgate.metaserver.store.keys import Keys, ttl_ms
from pdgate.metaserver.store.memory import MemoryStore, feed_seed
from pdgate.metaserver.store.redis import RedisStore, _split_url


def test_every_key_shares_one_hash_tag() -> None:
    k = Keys("ns1")
    names = [
        k.handoff("t1"),
        k.events("p0"),
        k.instance("i0"),
        k.deadlines,
        k.kv_counter,
        k.instances,
        k.left_pending,
        k.state_counts,
    ]
    tags = {re.search(r"\{([^}]*)\}", n).group(1) for n in names}  # type: ignore[union-attr]
    assert tags == {"ns1"}
    assert k.handoff("t1").startswith(k.handoff_prefix) and k.events("p0").startswith(k.events_prefix)


@pytest.mark.parametrize("prefix", ["", "a{b}", "a b", "x" * 65])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError):
        Keys(prefix)


def test_ttl_ms_never_zero() -> None:
    assert ttl_ms(0.0001) == 1 and ttl_ms(1.5) == 1500


def test_kv_key_floor_and_feed_seed_are_exact_in_a_double() -> None:
    for seed in (kv_key_floor(4102444800.0), feed_seed(4102444800.0)):  # year 2100
        assert seed < 2**53 and float(seed) == seed
    assert kv_key_floor(8.7e9) < 2**53  # year 2245


def test_open_store_picks_by_scheme() -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    store = open_store("redis://127.0.0.1:1/0?prefix=abc")  # no connection is made until first use
    assert isinstance(store, RedisStore) and store.keys.prefix == "abc"
    with pytest.raises(ValueError, match="memory://"):
        open_store("mongodb://x")
    with pytest.raises(ValueError):
        open_store("no-scheme")


def test_prefix_is_taken_out_of_the_redis_url() -> None:
    assert _split_url("redis://h:6379/2?prefix=p1&max_connections=5") == ("redis://h:6379/2?max_connections=5", "p1")
    assert _split_url("redis://h:6379/0") == ("redis://h:6379/0", "pdgate")

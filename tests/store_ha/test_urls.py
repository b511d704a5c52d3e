"""Store URLs for Sentinel and Cluster (no server needed): what each part means, and typed refusals."""

from __future__ import annotations

import pytest
from pdgate.metaserver.store import open_store
from pdgate.metaserver.store.keys import Keys
from pdgate.metaserver.store.redis import RedisStore
from pdgate.metaserver.store.redis_urls import DEFAULT_BUCKETS, parse_store_url
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot


def test_sentinel_url_names_sentinels_master_db_and_both_credentials() -> None:
    t = parse_store_url(
        "rediss+sentinel://app:s3cret@h1:26379,h2,[::1]:26380/mymaster/2"
        "?prefix=p1&sentinel_password=sp&ssl_ca_certs=/ca.pem&wait_replicas=1&wait_timeout_ms=250"
    )
    assert (t.mode, t.service, t.db, t.prefix) == ("sentinel", "mymaster", 2, "p1")
    assert t.nodes == (("h1", 26379), ("h2", 26379), ("::1", 26380))
    assert t.options == {"username": "app", "password": "s3cret", "ssl": True, "ssl_ca_certs": "/ca.pem"}
    assert t.sentinel_options == {"password": "sp", "ssl": True, "ssl_ca_certs": "/ca.pem"}
    assert (t.wait_replicas, t.wait_timeout_ms) == (1, 250)


def test_cluster_url_shards_the_ledger() -> None:
    t = parse_store_url("redis+cluster://:pw@h1:7000,h2:7001/0?prefix=x&buckets=16")
    assert (t.mode, t.nodes, t.buckets, t.options) == ("cluster", (("h1", 7000), ("h2", 7001)), 16, {"password": "pw"})
    assert parse_store_url("redis+cluster://h1").buckets == DEFAULT_BUCKETS


def test_plain_urls_still_go_to_redis_py_as_they_are() -> None:
    t = parse_store_url("redis://h:6379/2?prefix=p1&max_connections=5&wait_replicas=1")
    assert (t.mode, t.url, t.prefix, t.wait_replicas, t.buckets) == (
        "single",
        "redis://h:6379/2?max_connections=5",
        "p1",
        1,
        1,
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379",  # no master name
        "redis+sentinel://h1/m/0?socket_timeout=1",  # an option we do not pass through
        "redis+cluster://h1:7000/3",  # a cluster has db 0 only
        "redis+cluster://h1:7000?wait_replicas=1",  # WAIT cannot be routed on a cluster
        "redis+cluster://h1:x",
        "redis+mongo://h1",
    ],
)
def test_bad_urls_are_refused_at_start_up(url: str) -> None:
    with pytest.raises(ValueError):
        open_store(url)


def test_open_store_takes_the_new_schemes_without_connecting() -> None:
    for url in ("redis+sentinel://127.0.0.1:1/m/0", "rediss+cluster://127.0.0.1:1/0?prefix=q"):
        assert isinstance(open_store(url), RedisStore)


def test_buckets_cover_the_slot_space_evenly() -> None:
    """Each bucket's tag falls in its own 1/N of the slots, so N buckets spread over masters that own
    contiguous ranges as evenly as the ranges are."""
    keys = Keys("pdgate", buckets=64)
    for b, shard in enumerate(keys.shards):
        slot = key_slot(shard.deadlines.encode())
        assert b * REDIS_CLUSTER_HASH_SLOTS // 64 <= slot < (b + 1) * REDIS_CLUSTER_HASH_SLOTS // 64
        assert key_slot(shard.handoff("t").encode()) == key_slot(shard.events("p").encode()) == slot
    assert keys.bucket_of("prefill-7") == Keys("pdgate", buckets=64).bucket_of("prefill-7")  # every replica agrees

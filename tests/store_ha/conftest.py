"""Fixtures of the Redis high-availability and sharding tests: real Sentinel groups and Redis Clusters.

Marked `store_ha` (registered here): they start several redis-server processes each and take about a
minute in all (`-m 'not store_ha'` leaves them out).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest

from tests.store_ha.servers import RedisClusterServers, SentinelGroup


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "store_ha: real Redis Sentinel groups and Clusters started by the test (about a minute)"
    )


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """A fresh master, replica and three Sentinels (each test may kill or stop members)."""
    with closing(SentinelGroup().start()) as group:
        yield group


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One three-master cluster for every test here (each test uses its own key prefix)."""
    with closing(RedisClusterServers().start()) as cluster:
        yield cluster

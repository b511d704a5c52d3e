"""LocalMetaClient offers the same methods as MetaClient (the MetaAPI protocol), signature for signature."""

from __future__ import annotations

import inspect

from pdgate.metaserver.local import LocalMetaClient

from pdgate.meta_client import MetaAPI, MetaClient


def test_same_methods_and_signatures_as_metaclient() -> None:
    names = [n for n, v in vars(MetaAPI).items() if inspect.iscoroutinefunction(v)]
    assert len(names) >= 13
    for name in [*names, "health", "aclose"]:
        local, remote = getattr(LocalMetaClient, name), getattr(MetaClient, name)
        assert inspect.iscoroutinefunction(local), name
        assert inspect.signature(local) == inspect.signature(remote), name

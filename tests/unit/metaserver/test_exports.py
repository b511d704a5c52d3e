"""`metaserver/__init__.py` exports exactly the contract: the models and the client, nothing else."""

from __future__ import annotations

import types

import metaserver
from metaserver import client, models


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(metaserver).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(metaserver.__all__) == public
    assert len(metaserver.__all__) == len(set(metaserver.__all__))


def test_all_is_the_contract() -> None:
    assert set(metaserver.__all__) == set(models.__all__) | set(client.__all__)
    for name in metaserver.__all__:
        assert getattr(metaserver, name) is getattr(models, name, None) or getattr(metaserver, name) is getattr(
            client, name
        )

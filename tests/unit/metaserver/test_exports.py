"""`metaserver/__init__.py` exports exactly the contract: the models and the client, nothing else."""

from __future__ import annotations

import types

import pdgate.metaserver

from pdgate import meta_client as client
from pdgate import models


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(pdgate.metaserver).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(pdgate.metaserver.__all__) == public
    assert len(pdgate.metaserver.__all__) == len(set(pdgate.metaserver.__all__))


def test_all_is_the_contract() -> None:
    assert set(pdgate.metaserver.__all__) == set(models.__all__) | set(client.__all__)
    for name in pdgate.metaserver.__all__:
        assert getattr(pdgate.metaserver, name) is getattr(models, name, None) or getattr(
            pdgate.metaserver, name
        ) is getattr(client, name)

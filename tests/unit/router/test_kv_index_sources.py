"""Where the router finds each engine's KV-event publisher (router/kv_events.py: parse_sources, sources_for)."""

from __future__ import annotations

import pytest
from pdgate.router.kv_events import Source, parse_sources, sources_for
from pdgate.router.pairing import InstanceView

from pdgate.models import Role


def view(ident: str, url: str, dp_rank: int = 0) -> InstanceView:
    return InstanceView(ident, Role.PREFILL, url, "m", dp_rank=dp_rank)


def test_explicit_endpoints_with_and_without_replay() -> None:
    got = parse_sources(["p1=tcp://10.0.0.1:5557|tcp://10.0.0.1:5558", "p2=tcp://10.0.0.2:5557"])
    assert got == {
        "p1": Source("p1", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        "p2": Source("p2", "tcp://10.0.0.2:5557", None),
    }
    for bad in ("p1", "=tcp://h:1", "p1=http://h:1", "p1="):
        with pytest.raises(ValueError, match="--kv-events"):
            parse_sources([bad])


def test_derived_from_the_registration_with_the_dp_offset() -> None:
    views = [
        view("a", "http://10.0.0.1:8000"),
        view("b", "http://10.0.0.1:8000", dp_rank=2),
        view("c", "http://[::1]:8000"),
    ]
    got = sources_for(views, {}, port=5557, replay_port=5600)
    assert got["a"] == Source("a", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600")
    assert got["b"] == Source("b", "tcp://10.0.0.1:5559", "tcp://10.0.0.1:5602")
    assert got["c"].endpoint == "tcp://[::1]:5557"
    assert sources_for(views, {}, port=5557)["a"].replay is None


def test_explicit_wins_and_unnamed_instances_are_not_followed_without_a_port() -> None:
    explicit = parse_sources(["a=tcp://x:1"])
    views = [view("a", "http://10.0.0.1:8000"), view("b", "http://10.0.0.2:8000")]
    assert sources_for(views, explicit) == {"a": Source("a", "tcp://x:1")}
    assert sources_for(views, explicit, port=7)["a"] == Source("a", "tcp://x:1")
    assert sources_for(views, explicit, port=7)["b"].endpoint == "tcp://10.0.0.2:7"
    assert sources_for([], explicit) == {}  # an instance that left is no longer a source

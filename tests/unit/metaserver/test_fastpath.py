"""Which requests the fast path takes; everything else must fall through to FastAPI."""

from __future__ import annotations

import pytest
from pdgate.metaserver.fastpath import FAST_ROUTES, match
from pdgate.metaserver.routes import ROUTES


@pytest.mark.parametrize(
    ("method", "path", "query", "route", "params"),
    [
        ("POST", "/v1/handoffs", b"", "/v1/handoffs", {}),
        ("PUT", "/v1/handoffs/t1/ready", b"", "/v1/handoffs/{transfer_id}/ready", {"transfer_id": "t1"}),
        ("POST", "/v1/handoffs/t1/claim", b"", "/v1/handoffs/{transfer_id}/claim", {"transfer_id": "t1"}),
        ("POST", "/v1/handoffs/t1/done", b"", "/v1/handoffs/{transfer_id}/done", {"transfer_id": "t1"}),
        ("POST", "/v1/handoffs/t1/abort", b"", "/v1/handoffs/{transfer_id}/abort", {"transfer_id": "t1"}),
        ("POST", "/v1/handoffs/batch", b"", "/v1/handoffs/batch", {}),
        ("GET", "/v1/handoffs/t1", b"", "/v1/handoffs/{transfer_id}", {"transfer_id": "t1"}),
    ],
)
def test_hot_routes_are_taken(method: str, path: str, query: bytes, route: str, params: dict[str, str]) -> None:
    found = match(method, path, query)
    assert found is not None and found[0].path == route and found[1] == params


@pytest.mark.parametrize(
    ("method", "path", "query"),
    [
        ("GET", "/v1/handoffs/t1", b"wait=5"),  # long-polls go to FastAPI
        ("GET", "/v1/handoffs", b""),
        ("POST", "/v1/handoffs/t1/ready", b""),  # wrong method: FastAPI answers 405
        ("PUT", "/v1/handoffs/t1/claim", b""),
        ("POST", "/v1/handoffs//claim", b""),
        ("POST", "/v1/handoffs/t1/claim/x", b""),
        ("POST", "/v1/handoffsXYZ", b""),  # matched by prefix once: it created a handoff
        ("POST", "/v1/handoffs-evil/batch", b""),  # and this ran a batch
        ("POST", "/v1/handoffs/", b""),
        ("GET", "/v1/instances", b""),
        ("GET", "/health", b""),
    ],
)
def test_everything_else_falls_through(method: str, path: str, query: bytes) -> None:
    assert match(method, path, query) is None


def test_the_fast_routes_are_rows_of_the_one_table() -> None:
    assert FAST_ROUTES and all(any(r is row for row in ROUTES) for r in FAST_ROUTES)
    names = [r.name for r in ROUTES]
    assert len(names) == len(set(names))  # FastAPI's operation ids and the route class key on them

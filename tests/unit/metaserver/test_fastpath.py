"""Which requests the fast path takes; everything else must fall through to FastAPI."""

from __future__ import annotations

import pytest
from pdgate.metaserver.fastpath import _match


@pytest.mark.parametrize(
    ("method", "path", "query", "route", "tid"),
    [
        ("POST", "/v1/handoffs", b"", "/v1/handoffs", ""),
        ("PUT", "/v1/handoffs/t1/ready", b"", "/v1/handoffs/{transfer_id}/ready", "t1"),
        ("POST", "/v1/handoffs/t1/claim", b"", "/v1/handoffs/{transfer_id}/claim", "t1"),
        ("POST", "/v1/handoffs/t1/done", b"", "/v1/handoffs/{transfer_id}/done", "t1"),
        ("POST", "/v1/handoffs/t1/abort", b"", "/v1/handoffs/{transfer_id}/abort", "t1"),
        ("GET", "/v1/handoffs/t1", b"", "/v1/handoffs/{transfer_id}", "t1"),
    ],
)
def test_hot_routes_are_taken(method: str, path: str, query: bytes, route: str, tid: str) -> None:
    found = _match(method, path, query)
    assert found is not None and found[0][0] == route and found[1] == tid


@pytest.mark.parametrize(
    ("method", "path", "query"),
    [
        ("GET", "/v1/handoffs/t1", b"wait=5"),  # long-polls go to FastAPI
        ("GET", "/v1/handoffs", b""),
        ("POST", "/v1/handoffs/t1/ready", b""),  # wrong method: FastAPI answers 405
        ("PUT", "/v1/handoffs/t1/claim", b""),
        ("POST", "/v1/handoffs//claim", b""),
        ("POST", "/v1/handoffs/t1/claim/x", b""),
        ("GET", "/v1/instances", b""),
        ("GET", "/health", b""),
    ],
)
def test_everything_else_falls_through(method: str, path: str, query: bytes) -> None:
    assert _match(method, path, query) is None

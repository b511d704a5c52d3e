"""Per-request state of one proxied request: its transfer id, the live handoff, and how it ends."""

from __future__ import annotations

import os

from pdgate.router.errors import RouterError
from pdgate.router.pool import Tracker

_MAX_ANSWER = 64 << 20


def mint_transfer_id() -> str:
    """'pd-' + 128 random bits: nobody can guess the next id to create or squat it before the router
    does (a process prefix plus a counter could be read off one answer and pre-created)."""
    return "pd-" + os.urandom(16).hex()


class _Retry(Exception):
    """One attempt failed in a way another instance may not: carries the error to raise if none is left."""

    def __init__(self, error: RouterError) -> None:
        self.error = error


class _Flow:
    """Per-request state shared by the steps and the disconnect watcher."""

    __slots__ = (
        "abort_reason",
        "client_auth",
        "disconnected",
        "extra",
        "finished",
        "kv_key",
        "live",
        "prefill",
        "rid",
        "started",
        "tid",
    )

    def __init__(self, tid: str, rid: bytes, client_auth: bytes | None, extra: list[tuple[bytes, bytes]]) -> None:
        self.tid = tid
        self.rid = rid
        self.client_auth = client_auth
        self.extra = extra
        self.kv_key = 0
        self.live: str | None = None  # transfer id of a handoff that must be aborted if we fail
        self.prefill: Tracker | None = None
        self.abort_reason = "failed"
        self.disconnected = False
        self.finished = False
        self.started = False  # the response's status line went out

    def end(self) -> None:
        self.finished = True


def _snippet(data: bytes, n: int = 300) -> str:
    text = data[:n].decode("utf-8", "replace")
    return text + ("..." if len(data) > n else "")

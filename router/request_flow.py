"""Per-request state of one proxied request: its transfer id, the live handoff, and how it ends."""

from __future__ import annotations

import itertools
import os

from pdgate.router.errors import RouterError
from pdgate.router.pool import Tracker

_MAX_ANSWER = 64 << 20


_PROCESS = os.urandom(8).hex()
_SEQ = itertools.count(1)


def mint_transfer_id() -> str:
    """URL-safe and unique, valid as a metaserver id: 'pd-' + 64 random bits drawn once per process + a
    counter. Unique across router replicas and restarts without a random draw (a syscall) per request."""
    return f"pd-{_PROCESS}-{next(_SEQ):x}"


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

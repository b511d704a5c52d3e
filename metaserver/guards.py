"""Who may call a /v1 route, how many long-polls one process holds, and what a cursor looks like.

Shared by the FastAPI routes (`api.py`) and the fast path (`fastpath.py`) so both answer the same.

Access (`AccessGuard`): every /v1 route changes state or reveals internal addresses (instance URLs,
KV locations, request ids), so with an admin token each needs it (`auth_reads=False` opens the reads).
Without a token the metaserver is in protected mode, as Redis is: loopback peers only; anyone else gets
403 naming the setting that lifts it. /health, /metrics, /docs and /openapi.json stay open.

Engines (`check_engine`): an engine token (`pdgate.auth.engine_token`, derived from the admin token for
one instance id) is let in like the admin token, but names its instance, and the service lets it move
only that instance's side of a handoff: create and READY for its own prefill, claim and DONE for itself,
abort on a handoff it is party to; register, heartbeat, drain and delete only its own record. The shared
admin token keeps full access (operators, routers, engines deployed before engine tokens).

Long-polls (`LongPolls`): each holds a task, and on Redis a connection, for up to `max_wait_s`; past
`max_long_polls` at once a poll gets 429 with Retry-After instead of one more of each.

Cursors (`check_cursor`): one grammar for both stores, checked before either sees it, so an invalid
cursor is a 400 everywhere (`<n>` or `<n>-<m>`, decimal, each part at most 2**53 - 1).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from pdgate.metaserver.errors import AdminTokenRequired, InvalidInput
from pdgate.metaserver.settings import MetaSettings

from pdgate.auth import bearer, credential_matches, engine_of, is_loopback
from pdgate.errors import Code
from pdgate.meta_client import MetaError, MetaUnauthorized
from pdgate.models import MAX_SAFE_INT

__all__ = [
    "AccessGuard",
    "Forbidden",
    "InvalidCursor",
    "LongPolls",
    "TooManyLongPolls",
    "check_cursor",
    "check_engine",
]

_CURSOR = re.compile(r"^([0-9]{1,16})(?:-([0-9]{1,16}))?$")


class Forbidden(MetaUnauthorized):
    code = Code.FORBIDDEN


class InvalidCursor(InvalidInput):
    code = Code.INVALID_CURSOR


class TooManyLongPolls(MetaError):
    code = Code.TOO_MANY_REQUESTS


def check_cursor(cursor: str | None) -> str | None:
    """`cursor` when it is `<n>` or `<n>-<m>` (each part at most 2**53 - 1), else InvalidCursor (400)."""
    if cursor is None:
        return None
    m = _CURSOR.match(cursor)
    if m is None or any(int(part) > MAX_SAFE_INT for part in m.groups() if part is not None):
        raise InvalidCursor(
            f"query.cursor: {cursor[:80]!r} is not a cursor (give back the 'cursor' of the last answer, "
            "or leave it out to start at the oldest event kept)"
        )
    return cursor


class AccessGuard:
    """Decides, per request, whether the caller may use a /v1 route (see the module docstring)."""

    def __init__(self, settings: MetaSettings) -> None:
        self.admin_token = settings.admin_token
        self.auth_reads = settings.auth_reads

    def check(self, authorization: str | None, peer: str | None, *, write: bool, admin: bool = False) -> str | None:
        """Raise AdminTokenRequired (401) or Forbidden (403) unless the caller may go on; else the instance
        id of the caller's engine token, or None for full access (admin token, loopback in protected
        mode, an open read). `admin`: the route is the admin token's alone (no engine token)."""
        if not write and not self.auth_reads and not admin:
            return None
        if self.admin_token is None:
            if not is_loopback(peer):
                raise Forbidden(
                    "protected mode: no admin token is configured, so /v1 routes answer loopback peers only; "
                    "set PDGATE_ADMIN_TOKEN or --admin-token-file on the metaserver and send "
                    "'Authorization: Bearer <token>'"
                )
            return None
        token = bearer(authorization)
        if credential_matches(token, self.admin_token):
            return None
        engine = engine_of(token, self.admin_token)
        if engine is None:
            raise AdminTokenRequired("this route needs 'Authorization: Bearer <admin token>' (or an engine token)")
        if admin:
            raise Forbidden(f"this route needs the admin token; an engine token (for {engine}) is not enough")
        return engine


def check_engine(engine: str | None, allowed: tuple[str | None, ...], what: str) -> None:
    """Forbidden (403) unless the caller has full access (`engine` None) or its engine token's instance is
    one of `allowed` (the instance ids whose side of the handoff or record this call moves)."""
    if engine is not None and engine not in allowed:
        raise Forbidden(f"an engine token for {engine} cannot {what}")


class LongPolls:
    """A counter of long-polls in progress; `hold()` refuses one past the cap with 429."""

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.active >= self.limit:
            raise TooManyLongPolls(
                f"{self.active} long-polls are in progress, the most this metaserver holds at once "
                f"(max_long_polls); retry after {self.retry_after_s} s or poll without ?wait="
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

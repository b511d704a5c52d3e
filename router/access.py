"""Who may use what on the router: client API keys for the OpenAI routes, the admin token for the rest.

Two credentials, never mixed up: client keys (`--api-key`, `--api-key-file`) open `/v1/completions`,
`/v1/chat/completions` and `/v1/models`; the admin token (`--admin-token-file`, the environment)
opens the embedded metaserver's `/v1/instances` and `/v1/handoffs` and the instance URLs in
`/health`. A client key never grants an admin right. With no admin token the router is in protected
mode, as the metaserver is: the admin rights belong to loopback peers only. With an external
metaserver, its token (`--metaserver-token-file`) is the cluster's admin token and also opens the
instance URLs in `/health`.

Comparisons go through `pdgate.auth` (constant time, every key compared).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdgate.auth import bearer, credential_matches, is_loopback, matches_any

__all__ = ["AdminCheck", "ClientKeys"]


class ClientKeys:
    """The client API keys; empty means the OpenAI routes are open."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, authorization: bytes | str | None) -> bool:
        if not self.keys:
            return True
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        return matches_any(bearer(authorization), self.keys)


class AdminCheck:
    """Whether a caller holds the admin right: the token when one is set, else a loopback address."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def holds(self, authorization: str | None, peer: str | None) -> bool:
        if self.token is None:
            return is_loopback(peer)
        return credential_matches(bearer(authorization), self.token)

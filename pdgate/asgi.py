"""The raw ASGI callable types the router's hot path is written against (no framework on that path)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ACCESS_NOTE", "Message", "Receive", "Scope", "Send", "add_access_note"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# A scope key whose value the access log line ends with: the app writes what it decided about the request
# (the router: `whole:short_prompt`, `pd:long_prompt`), the server's protocol reads it when it logs.
ACCESS_NOTE = "pdgate.access_note"


def add_access_note(scope: Scope, note: str) -> None:
    """Append `note` to the request's access-log note (a request split into prompts has one per prompt)."""
    prior = scope.get(ACCESS_NOTE)
    scope[ACCESS_NOTE] = note if not prior else f"{prior},{note}"

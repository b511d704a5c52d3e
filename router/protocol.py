"""How the proxy learns that its client went away: a hook the router's HTTP protocol fires, or a watcher.

Why a hook: ASGI's only way to see a disconnect is to keep a `receive()` pending for the whole request,
which under uvicorn is one extra task per request, an `asyncio.Event` wait, and a wake-up when the
response completes (measured: bench/results/router-profile-before.txt). The router's protocol
(`watching_protocol`, a subclass of the one `pdgate.serving` guards) instead puts a `DisconnectHook` in the
scope of each proxied request (`scope["extensions"]["pdgate.disconnect"]`) and calls it from
`connection_lost`, where the disconnect is known first. Served by anything else (tests over
`httpx.ASGITransport`, another server), the proxy falls back to the pending `receive()` (`Watch`).

Writing an answer's head and body in one write is `fastlane`'s: uvloop sends each `transport.write` at
once when its buffer is empty, so uvicorn's two writes are two syscalls (`/proc/<pid>/io` under
bench/router.py; an earlier strace reading here had it the other way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pdgate.asgi import Message, Receive, Scope

__all__ = ["EXTENSION", "DisconnectHook", "Watch", "watching_protocol"]

EXTENSION = "pdgate.disconnect"


class DisconnectHook:
    """One proxied request's line to its connection: `watch(callback)` until `unwatch()`."""

    __slots__ = ("_live", "callback")

    def __init__(self, live: set[DisconnectHook]) -> None:
        self._live = live
        self.callback: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self._live.add(self)

    def unwatch(self) -> None:
        self._live.discard(self)
        self.callback = None

    def fire(self) -> None:
        cb = self.callback
        self.unwatch()
        if cb is not None:
            cb()


class Watch:
    """Calls `on_disconnect` once if the client goes away, until `stop()`: through the scope's hook when
    the server gives one, else through a pending `receive()`."""

    __slots__ = ("_hook", "_watcher")

    def __init__(self, scope: Scope, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        ext = scope.get("extensions")
        hook = ext.get(EXTENSION) if ext else None
        self._hook: DisconnectHook | None = hook
        self._watcher: asyncio.Future[Message] | None = None
        if hook is not None:
            hook.watch(on_disconnect)
            return
        watcher = self._watcher = asyncio.ensure_future(receive())

        def done(fut: asyncio.Future[Message]) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result().get("type") == "http.disconnect":
                on_disconnect()

        watcher.add_done_callback(done)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.unwatch()
        elif self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()


def watching_protocol(base: type[Any], paths: frozenset[str]) -> type[Any]:
    """A subclass of uvicorn's httptools protocol `base` that gives requests to `paths` a `DisconnectHook`."""

    class Watching(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            self._pd_live: set[DisconnectHook] = set()
            super().connection_made(transport)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            scope = self.scope
            cycle = self.cycle
            if cycle is None or cycle.scope is not scope:  # refused before a cycle began (413, upgrade)
                return
            # The cycle's task was created but has not run: the hook is in the scope before the app starts.
            if scope.get("path") in paths:
                ext = scope.get("extensions")
                if ext is None:
                    ext = scope["extensions"] = {}
                ext[EXTENSION] = DisconnectHook(self._pd_live)

        def connection_lost(self, exc: Exception | None) -> None:
            live = self._pd_live
            while live:
                live.pop().fire()
            super().connection_lost(exc)

    Watching.__name__ = Watching.__qualname__ = f"Watching{base.__name__}"
    return Watching

"""The router's one table of raw ASGI routes, and the server's fast lane derived from it.

`RAW_ROUTES` is what `RouterApp` dispatches before FastAPI: the two proxy routes (`proxy.Proxy`) and
vLLM's routes passed whole to one instance (`passthrough.Passthrough`), each with the one method it
serves (another method gets a 405 with `Allow`). A row marked `lane` is also taken by the server's fast
lane (`fastlane`: a leaner server cycle for the same app, measured there). With the embedded metaserver,
the lane also takes the engines' ledger calls: the rows of the metaserver's own table
(`metaserver.routes.ROUTES`, served by its `FastPath`) marked `fast` whose request has a body.

Why one table: the lane and the app were two lists of the same routes, and a route could be added to one
and not the other. Now `lane_routes` is computed from the tables the app itself is built from, so every
route the lane takes is a route of the app (tests/integration/router/test_router_fast_lane.py checks
that, and that the lane answers as uvicorn's cycle does).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pdgate.router.bodies import CHAT, COMPLETIONS
from pdgate.router.errors import error_body
from pdgate.router.fastlane import with_fast_lane
from pdgate.router.passthrough import GET_ROUTES, POST_ROUTES
from pdgate.router.protocol import watching_protocol
from pdgate.router.settings import RouterSettings

from pdgate.errors import Code, info
from pdgate.serving import ServerLimits, guarded_protocol

__all__ = ["PROXY_PATHS", "RAW_ROUTES", "RawRoute", "lane_routes", "render_openai", "serving_protocol"]

_BODY_METHODS = frozenset({"POST", "PUT"})  # the lane reads a Content-Length body; nothing else


@dataclass(frozen=True)
class RawRoute:
    """A route RouterApp serves itself: its one method, who answers it, and whether the fast lane takes it."""

    method: Literal["GET", "POST"]
    handler: Literal["proxy", "passthrough"]
    lane: bool = False


RAW_ROUTES: dict[str, RawRoute] = {
    COMPLETIONS: RawRoute("POST", "proxy", lane=True),
    CHAT: RawRoute("POST", "proxy", lane=True),
    **{path: RawRoute("POST", "passthrough") for path in sorted(POST_ROUTES)},
    **{path: RawRoute("GET", "passthrough") for path in sorted(GET_ROUTES)},
}
PROXY_PATHS = frozenset(path for path, route in RAW_ROUTES.items() if route.handler == "proxy")


def lane_routes(embedded: bool) -> tuple[tuple[str, str], ...]:
    """(method, path template) of every route the fast lane takes: the router's own lane rows, and with the
    embedded metaserver the ledger's fast rows that carry a body (READY is a PUT; claim, DONE, abort and
    batches POSTs; the router's own create and claim are in-process calls)."""
    routes = tuple((route.method, path) for path, route in RAW_ROUTES.items() if route.lane)
    if not embedded:
        return routes
    from pdgate.metaserver.fastpath import FAST_ROUTES

    return routes + tuple((r.method, r.path) for r in FAST_ROUTES if r.method in _BODY_METHODS)


def _template(path: str) -> str:
    """A path template (`/v1/handoffs/{transfer_id}/ready`) as a regular expression of one segment each."""
    return "/".join("[^/]+" if s.startswith("{") and s.endswith("}") else re.escape(s) for s in path.split("/"))


def lane_predicate(routes: tuple[tuple[str, str], ...]) -> Callable[[bytes, bytes], bool]:
    """`lane(method, raw path)` for `fastlane.with_fast_lane`: exact paths by one set lookup (the proxy
    routes, first), templated ones by one regular expression."""
    exact = frozenset((m.encode(), p.encode()) for m, p in routes if "{" not in p)
    templated = [f"{re.escape(m)} {_template(p)}" for m, p in routes if "{" in p]
    pattern = re.compile("|".join(templated).encode()) if templated else None

    def lane(method: bytes, url: bytes) -> bool:
        if (method, url) in exact:
            return True
        return pattern is not None and pattern.fullmatch(method + b" " + url) is not None

    return lane


def render_openai(code: Code, detail: str) -> tuple[bytes, bytes]:
    """A refusal of `pdgate.serving` (408, 413, 503 before the app runs) as an OpenAI error body."""
    return b"application/json", error_body(detail, info(code).openai_type, code.value)


def serving_protocol(s: RouterSettings, *, fast_lane: bool = True) -> type[Any]:
    """uvicorn's HTTP protocol for the router (`uvicorn.Config(http=...)`): slow clients are cut off,
    an over-long Content-Length gets 413 before its body is read, connections are counted, and a proxied
    request hears of its client's disconnect from the protocol itself (`protocol`). With `fast_lane` (the
    default; off only to compare), the routes of `lane_routes` run on the lean cycle of `fastlane`
    instead of uvicorn's."""
    limits = ServerLimits(
        header_timeout_s=s.header_timeout_s,
        body_timeout_s=s.body_timeout_s,
        max_body_bytes=s.max_body_bytes,
        max_connections=s.max_connections,
    )
    guarded = guarded_protocol(limits, render_openai)
    if fast_lane:
        guarded = with_fast_lane(guarded, lane_predicate(lane_routes(s.embedded)))
    return watching_protocol(guarded, PROXY_PATHS)

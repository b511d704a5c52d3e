"""The methods a path is served with, for a 405's `Allow` header, asked of the routes themselves.

Starlette names only the first matching route's methods, and FastAPI from 0.14x wraps an included
router in one route that has no `methods` at all, so reading `route.methods` off `app.router.routes`
missed every route of the metaserver's included router. Asking each route whether it would take the
path with a given method (`Match.FULL`) holds for plain routes and wrapped routers alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.routing import BaseRoute, Match

__all__ = ["METHODS", "allowed_methods"]

METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> str:
    """Every method some route in `routes` serves at `scope`'s path, sorted, comma-separated."""
    served = set()
    routes = list(routes)
    for method in METHODS:
        probe = {**scope, "method": method}
        if any(route.matches(probe)[0] is Match.FULL for route in routes):
            served.add(method)
    return ", ".join(sorted(served))

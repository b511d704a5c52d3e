"""`GET /health`: whether the router can serve a request now, and why not.

Why it must tell the truth: load balancers and orchestrators act on it. It answers 503 with the reason
while no compatible pair is available, and also while the metaserver (or its store) is unreachable,
because every request then fails at the handoff step even though the last registry snapshot still
lists healthy instances.

Who sees what: instance URLs and ids (an id defaults to `<host>-<port>`), and the detailed reason of a
failed registry read, which may hold the metaserver's address, are shown only to a caller holding the
admin right (`access.AdminCheck`), since an engine's address lets a caller bypass the router's keys.
Everyone else gets the same verdict, the same per-instance availability under each instance's opaque
name (`Pool.public_name`, the name client errors use; the admin's rows pair it with the id as
`public_id`), and reasons that never name an address.

Registry records the router left out of its pool (`left_out.LeftOut`: outside
`--allowed-engine-networks`, its own address, a URL that breaks the rule) are in the reason while no
pair serves, and listed under `left_out` always: their reasons and models for anyone, ids and URLs for
the admin. Without them an engine the router refuses looks like no engine at all.
"""

from __future__ import annotations

from typing import Any

from pdgate.router.discovery import Discovery
from pdgate.router.left_out import unpooled
from pdgate.router.pool import Pool

__all__ = ["health_body"]


def health_body(pool: Pool, discovery: Discovery, now: float, *, full: bool) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of `GET /health`; `full` adds instance URLs and raw registry errors."""
    served = pool.models(now)
    reason: str | None = None
    registry = discovery.registry_reason
    if registry is not None:
        reason = f"the registry cannot be read: {registry}; requests fail until it can"
    elif not served:
        known = pool.known_models()
        if not known:
            reason = unpooled(pool.left_out, None, full=full)
        else:
            reason = "; ".join(pool.explain(m, now, public=not full) for m in known)  # left-out ones included
    instances = []
    for inst in pool.instances.values():
        row: dict[str, Any] = {
            "id": inst.id if full else inst.public,
            "role": inst.view.role.value,
            "model": inst.view.model,
            "dp_rank": inst.view.dp_rank,
            "available": (why := inst.unavailable(now)) is None,
            "reason": why,
            "inflight": inst.requests,
            "breaker": inst.breaker.state(now).value,
        }
        if full:
            row["public_id"] = inst.public
            row["url"] = inst.view.url
        instances.append(row)
    ok = bool(served) and registry is None
    body = {
        "status": "ok" if ok else "unavailable",
        "reason": reason,
        "models": served,
        "registry_error": discovery.registry_error if full else registry,
        "instances": instances,
        "left_out": [
            {"id": o.id, "url": o.url, "model": o.model, "reason": o.why}
            if full
            else {"model": o.model, "reason": o.why}
            for o in pool.left_out
        ],
    }
    return (200 if ok else 503), body

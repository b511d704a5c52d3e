"""Registry records the router's pool does not hold (refused by `--allowed-engine-networks`, the URL rule,
or for being the router's own address), and how they are said: to a client by count and reason only
(SECURITY.md: instance URLs are admin-only), to the admin and the log with ids and URLs. Discovery
fills `Pool.left_out`; the no-pair errors and `/health` say it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["LeftOut", "left_out_said", "unpooled"]


class LeftOut(NamedTuple):
    """A registry record the pool does not hold. `why` names no address: anyone may read it."""

    id: str
    url: str
    model: str | None
    why: str


def unpooled(left_out: Sequence[LeftOut], model: str | None, *, full: bool) -> str:
    """Why no prefill or decode instance (of `model`, when one is named) is in the pool."""
    said = left_out_said(left_out, model, full=full)
    return (
        "no prefill or decode instance is registered"
        if said is None
        else f"no prefill or decode instance is in the pool: {said}"
    )


def left_out_said(left_out: Sequence[LeftOut], model: str | None, *, full: bool) -> str | None:
    """The records left out (of `model`'s, when one is named), their count and reasons; `full` (the admin,
    the log) adds each one's id and URL, which a client must not read (SECURITY.md: instance URLs are
    admin-only). None when none is."""
    mine = [o for o in left_out if model is None or o.model in (model, None)]
    if not mine:
        return None
    counts = Counter(o.why for o in mine)
    if full:
        whys = "; ".join(f"{why}: {', '.join(f'{o.id} {o.url}' for o in mine if o.why == why)}" for why in counts)
    else:
        whys = "; ".join(f"{n} {why}" for why, n in counts.items())
    tail = "" if full else "; the router's log names them"
    return f"{len(mine)} registered instance(s) were left out of the pool ({whys}){tail}"

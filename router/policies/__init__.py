"""Instance-selection policies: pure functions of a candidate list, the request and an rng.

A policy gets the *eligible* instances (`pool.LiveInstance`s; the pool filtered out draining,
unhealthy, breaker-open and incompatible ones before), the request's facts and a `Random`; it returns
an index or None. It never records anything: the caller counts the request against the instance it
dispatches to (`Pool.lease`). Each policy lives in its own module; `POLICIES` maps names (the
`--prefill-policy`/`--decode-policy` values) to classes, and `make_policy` builds one.

Load, the same for every policy that looks at it: the router's own in-flight requests to the instance
(live), plus the requests others had on it as of its last report to the registry (`LiveInstance.others`:
other router replicas' traffic shows only there), plus in-flight tokens / `TOKEN_UNIT`, so a few long
prompts weigh like many short ones. The report alone trails the engine by a heartbeat and a registry
read; the router's own count does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import Any, ClassVar, Protocol

from pdgate.router.bodies import RequestFacts
from pdgate.router.pool import LiveInstance

__all__ = ["POLICIES", "TOKEN_UNIT", "Policy", "load_of", "make_policy"]

TOKEN_UNIT = 2048


def load_of(c: LiveInstance) -> float:
    return c.requests + c.others + c.tokens / TOKEN_UNIT


class Policy(Protocol):
    name: ClassVar[str]

    def choose(self, candidates: Sequence[LiveInstance], req: RequestFacts, rng: Random) -> int | None: ...


def _registry() -> dict[str, type[Any]]:
    from pdgate.router.policies.cache_aware import CacheAware
    from pdgate.router.policies.least_load import LeastLoad
    from pdgate.router.policies.power_of_two import PowerOfTwo
    from pdgate.router.policies.prefix_affinity import PrefixAffinity
    from pdgate.router.policies.round_robin import RoundRobin

    return {cls.name: cls for cls in (RoundRobin, LeastLoad, PowerOfTwo, PrefixAffinity, CacheAware)}


POLICIES: dict[str, type[Any]] = _registry()


def make_policy(name: str, **options: Any) -> Policy:
    """Build the policy `name`; options a policy does not take are ignored (one settings object feeds all)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    accepted = getattr(cls, "OPTIONS", ())
    policy: Policy = cls(**{k: v for k, v in options.items() if k in accepted})
    return policy

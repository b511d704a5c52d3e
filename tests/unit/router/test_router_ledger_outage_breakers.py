"""Pool.ledger_outage / CircuitBreaker.forgive: a shared outage opens no instance's breaker (issue 10).

While the ledger is down every decode fails its claim; counting that against each decode would open all
the breakers, and the router would refuse work (`pd_no_compatible_pair`) for `open_s` after the store is
back. Failures in the moments before the outage was noticed are forgiven; failures after it ends count.
"""

from __future__ import annotations

from pdgate.router.breaker import BreakerConfig, BreakerState, CircuitBreaker
from pdgate.router.pairing import InstanceView
from pdgate.router.pool import Pool

from pdgate.models import Role

P = InstanceView(id="p", role=Role.PREFILL, url="http://p:1", model="m")
D = InstanceView(id="d", role=Role.DECODE, url="http://d:1", model="m")
E = InstanceView(id="e", role=Role.DECODE, url="http://e:1", model="m")


def _fail(pool: Pool, iid: str, at: float) -> None:
    with pool.lease(pool.instances[iid], 1, lambda: at) as lease:
        lease.failed()


def test_outage_forgives_recent_opens_and_suspends_verdicts_until_it_ends() -> None:
    pool = Pool(BreakerConfig(failures=1, open_s=100))
    pool.replace([P, D, E])
    _fail(pool, "e", at=1.0)  # opened before the last good read: its own fault
    _fail(pool, "d", at=5.0)  # opened after it: maybe the outage's
    assert pool.models(6.0) == []  # both decodes out: nothing can be served
    assert pool.ledger_outage(since=4.0) == ["d"]
    assert pool.instances["d"].breaker.state(6.0) is BreakerState.CLOSED
    assert pool.instances["e"].breaker.state(6.0) is BreakerState.OPEN
    _fail(pool, "d", at=7.0)  # during the outage: no verdict
    assert pool.instances["d"].breaker.state(7.0) is BreakerState.CLOSED and pool.models(7.0) == ["m"]
    pool.ledger_back()
    _fail(pool, "d", at=8.0)  # the ledger is back: failures are the instance's again
    assert pool.instances["d"].breaker.state(8.0) is BreakerState.OPEN


def test_forgive_leaves_closed_and_older_breakers_alone() -> None:
    moves: list[tuple[BreakerState, BreakerState]] = []
    b = CircuitBreaker(BreakerConfig(failures=1, open_s=10), lambda a, z: moves.append((a, z)))
    assert not b.forgive(since=0.0)  # closed: nothing to forgive
    b.record_failure(3.0)
    assert not b.forgive(since=4.0)  # opened before `since`
    assert b.forgive(since=3.0) and b.state(3.5) is BreakerState.CLOSED
    assert moves == [(BreakerState.CLOSED, BreakerState.OPEN), (BreakerState.OPEN, BreakerState.CLOSED)]

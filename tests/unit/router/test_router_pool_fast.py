"""The pool's clock-free candidate lists (issue 12): kept between changes, never stale, never different.

The oracle tests every instance at every decision, as the pool did before the lists (`unavailable` at
`now`, and a prefill only when some decode of its class is available). A run of random changes (health
verdicts, breakers opening, their wait running out, probes succeeding or failing, drains, instances
leaving and coming back, a shared ledger outage forgiving breakers) must leave the pool's candidates
equal to the oracle's, in the same order, after every single change and for random exclusions.
"""

from __future__ import annotations

from dataclasses import replace
from random import Random

import pytest
from pdgate.router.breaker import BreakerConfig
from pdgate.router.pairing import InstanceView
from pdgate.router.pool import LiveInstance, Pool

from pdgate.models import Role

OPEN_S = 5.0


def _views(n: int, *, both: int = 0) -> list[InstanceView]:
    views = [
        InstanceView(id=f"b{i:02d}", role=Role.BOTH, url=f"http://10.0.1.{i}:8000", model="m", block_size=16)
        for i in range(both)
    ]
    for i in range(n):
        for role, tag in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            views.append(
                InstanceView(
                    id=f"{tag}{i:02d}",
                    role=role,
                    url=f"http://10.0.0.{i}:{8000 + (role is Role.DECODE)}",
                    model="m",
                    block_size=(16, 32)[i % 2],  # two compatibility classes
                )
            )
    return views


def _oracle_prefills(pool: Pool, now: float, exclude: list[str]) -> list[str]:
    out = []
    for p in pool.prefills.get("m", ()):
        if p.id in exclude or p.unavailable(now) is not None:
            continue
        if any(d.unavailable(now) is None for d in pool._compatible.get(p.compat, ())):
            out.append(p.id)
    return out


def _oracle_decodes(pool: Pool, prefill: LiveInstance, now: float, exclude: list[str]) -> list[str]:
    decodes = pool._compatible.get(prefill.compat, ())
    return [d.id for d in decodes if d.id not in exclude and d.unavailable(now) is None]


def _oracle_whole(pool: Pool, now: float, exclude: list[str]) -> list[str]:
    """Either side's available instances, decodes first, an instance of role both once."""
    out: list[str] = []
    for side in (pool.decodes, pool.prefills):
        for i in side.get("m", ()):
            if i.id not in exclude and i.id not in out and i.unavailable(now) is None:
                out.append(i.id)
    return out


def _check(pool: Pool, now: float, rng: Random) -> None:
    ids = list(pool.instances)
    for exclude in ([], rng.sample(ids, min(3, len(ids)))):
        got = [p.id for p in pool.prefill_candidates("m", now, exclude)]
        assert got == _oracle_prefills(pool, now, exclude)
        whole = [i.id for i in pool.whole_candidates("m", now, exclude, either=True)]
        assert whole == _oracle_whole(pool, now, exclude)
        for p in pool.prefills.get("m", ()):
            got_d = [d.id for d in pool.decode_candidates(p, now, exclude)]
            assert got_d == _oracle_decodes(pool, p, now, exclude), (p.id, exclude)


@pytest.mark.parametrize("seed", range(12))
def test_candidates_equal_the_instance_by_instance_oracle_after_every_change(seed: int) -> None:
    rng = Random(seed)
    views = _views(6, both=2)
    pool = Pool(BreakerConfig(failures=2, open_s=OPEN_S, successes=1))
    pool.replace(views)
    now = 0.0
    current = list(views)
    for _ in range(200):
        op = rng.randrange(8)
        inst = rng.choice(list(pool.instances.values()))
        if op == 0:
            pool.set_health(inst.view.url, rng.random() < 0.5, "probe")
        elif op in (1, 2):  # a failed request (two in a row open the breaker)
            with pool.lease(inst, 1, lambda t=now: t) as lease:
                lease.failed()
        elif op == 3:  # a good request: closes a half-open breaker
            with pool.lease(inst, 1, lambda t=now: t) as lease:
                lease.succeeded()
        elif op == 4:
            now += rng.choice([0.5, OPEN_S])  # open breakers' wait may run out (half-open)
        elif op == 5:  # drain one, or undrain
            current = [replace(v, draining=not v.draining) if v.id == inst.id else v for v in current]
            pool.replace(current)
        elif op == 6:  # one leaves, or every one is back
            current = [v for v in current if v.id != inst.id] if rng.random() < 0.5 else list(views)
            pool.replace(current)
        else:
            pool.ledger_outage(since=now - rng.random() * OPEN_S)  # forgives breakers opened since then
            pool.ledger_back()
        _check(pool, now, rng)


def test_a_list_is_kept_between_decisions_and_rebuilt_after_a_change() -> None:
    pool = Pool(BreakerConfig(failures=1, open_s=OPEN_S))
    pool.replace(_views(4))
    first = pool.prefill_candidates("m", 0.0)
    assert pool._fast_p["m"] is not None and len(first) == 4
    first.pop()  # the caller's copy: the kept list is not the one handed out
    assert len(pool.prefill_candidates("m", 0.0)) == 4
    assert len(pool.whole_candidates("m", 0.0, either=True)) == 8 and pool._fast_w["m"] is not None
    pool.set_health("http://10.0.0.1:8000", False, "down")
    assert [p.id for p in pool.prefill_candidates("m", 0.0)] == ["p00", "p02", "p03"]
    d0 = pool.instances["d00"]
    with pool.lease(d0, 1, lambda: 0.0) as lease:
        lease.failed()  # d00's breaker opens: its class's lists depend on the clock now
    assert pool._fast_p == {} and pool._fast_d == {} and pool._fast_w == {}
    assert [p.id for p in pool.prefill_candidates("m", 0.0)] == ["p00", "p02", "p03"]  # d02 serves p00's class
    assert pool._fast_p["m"] is None
    assert [d.id for d in pool.decode_candidates(pool.instances["p00"], OPEN_S)] == ["d00", "d02"]  # half-open

"""pool.py pairs compatibility classes, not instances (issue 12): same choices as pair by pair, far less work.

The oracle is the pair-by-pair pool the router had before: every prefill checked against every decode
with the rule itself (`pairing.compatible`, i.e. `pdgate.contract.mismatch`), in id order.
Random fleets mix every compatibility field, wildcards (None) included, and random availability
(health, draining, open breakers); the grouped pool must give the same candidate lists in the same
order, hence the same least-load choice, and never a pair the rule refuses.
"""

from __future__ import annotations

from dataclasses import replace
from random import Random

import pytest
from pdgate.router import pool as pool_module
from pdgate.router.bodies import RequestFacts
from pdgate.router.breaker import BreakerConfig
from pdgate.router.pairing import InstanceView, compatible
from pdgate.router.policies import make_policy
from pdgate.router.pool import LiveInstance, Pool

from pdgate.contract import KVShape
from pdgate.models import Role, TransportKind


def _view(rng: Random, i: int, role: Role) -> InstanceView:
    return InstanceView(
        id=f"{role.value[0]}{i:03d}",
        role=role,
        url=f"http://10.0.{i // 200}.{i % 200}:{8000 + (role is Role.DECODE)}",
        model=rng.choice(["m", "m", "m", "other", None]),
        tp_size=rng.choice([1, 2, 4, None]),
        block_size=rng.choice([16, 16, 32, None]),
        kv_dtype=rng.choice(["auto", "fp8", None]),
        kv_layout=rng.choice(["", "HND", None]),
        kv_replicated=rng.random() < 0.3,
        transport=rng.choice([TransportKind.NIXL, None, *list(TransportKind)]),
        draining=rng.random() < 0.05,
        reported=rng.randrange(8),
    )


def _fleet(seed: int, n_p: int, n_d: int) -> tuple[Pool, Random]:
    rng = Random(seed)
    views = [_view(rng, i, rng.choice([Role.PREFILL, Role.PREFILL, Role.BOTH])) for i in range(n_p)]
    views += [_view(rng, i, Role.DECODE) for i in range(n_d)]
    pool = Pool(BreakerConfig(failures=1, open_s=100))
    pool.replace(views)
    for inst in pool.instances.values():
        if rng.random() < 0.1:
            pool.set_health(inst.view.url, False, "down")
        if rng.random() < 0.1:
            with pool.lease(inst, 1, lambda: 0.0) as lease:
                lease.failed()  # its breaker opens
        inst.requests = rng.randrange(4)
    return pool, rng


def _oracle_prefills(pool: Pool, model: str, now: float) -> list[LiveInstance]:
    insts = list(pool.instances.values())
    return [
        p
        for p in insts
        if p.view.role.can_prefill()
        and p.view.model == model
        and p.unavailable(now) is None
        and any(
            d.view.role.can_decode()
            and d.view.model == model
            and d.unavailable(now) is None
            and compatible(p.view, d.view)
            for d in insts
        )
    ]


def _oracle_decodes(pool: Pool, p: LiveInstance, now: float) -> list[LiveInstance]:
    return [
        d
        for d in pool.instances.values()
        if d.view.role.can_decode()
        and d.view.model == p.view.model
        and d.unavailable(now) is None
        and compatible(p.view, d.view)
    ]


FACTS = RequestFacts(endpoint="/v1/completions", model="m", stream=False, prompt_tokens=10, max_tokens=10, prefix=b"")


@pytest.mark.parametrize("seed", range(12))
def test_same_candidates_and_least_load_choice_as_pair_by_pair(seed: int) -> None:
    pool, rng = _fleet(seed, 60, 60)
    least = make_policy("least_load")
    for model in ("m", "other"):
        ps = pool.prefill_candidates(model, 1.0)
        assert [p.id for p in ps] == [p.id for p in _oracle_prefills(pool, model, 1.0)]
        for p in ps:
            ds = pool.decode_candidates(p, 1.0)
            assert [d.id for d in ds] == [d.id for d in _oracle_decodes(pool, p, 1.0)]
            assert ds, f"{p.id} was offered without a decode that can take its KV"
            assert all(compatible(p.view, d.view) for d in ds)  # never an incompatible pair
            k = rng.random()  # ties are broken at random: the same draw for both
            assert least.choose(ds, FACTS, Random(k)) == least.choose(_oracle_decodes(pool, p, 1.0), FACTS, Random(k))
        if ps:
            k = rng.random()
            assert least.choose(ps, FACTS, Random(k)) == least.choose(
                _oracle_prefills(pool, model, 1.0), FACTS, Random(k)
            )


def test_a_change_at_1000_x_1000_applies_the_rule_per_class_pair_not_per_instance_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    def counting(p: KVShape, d: KVShape) -> bool:
        nonlocal calls
        calls += 1
        return compatible(p, d)  # type: ignore[arg-type]

    monkeypatch.setattr(pool_module, "compatible_views", counting)
    ps = [
        InstanceView(id=f"p{i:04d}", role=Role.PREFILL, url=f"http://p{i}:1", model="m", block_size=16)
        for i in range(1000)
    ]
    ds = [
        InstanceView(id=f"d{i:04d}", role=Role.DECODE, url=f"http://d{i}:1", model="m", block_size=16)
        for i in range(1000)
    ]
    ds[::2] = [InstanceView(id=v.id, role=Role.DECODE, url=v.url, model="m", block_size=32) for v in ds[::2]]
    pool = Pool()
    pool.replace(ps + ds)
    assert calls == 2  # one prefill class x two decode classes
    calls = 0
    pool.replace([*ps, *ds, replace(ps[0], id="p9999", url="http://new:1")])
    assert calls == 2
    [p] = pool.prefill_candidates("m", 0.0)[:1]
    assert {d.view.block_size for d in pool.decode_candidates(p, 0.0)} == {16}
    assert len(pool.decode_candidates(pool.instances["p9999"], 0.0)) == 500


def test_the_class_key_covers_every_field_the_rule_reads() -> None:
    """Grouping by `compat_key` is only sound if the key holds every field of the contract's KVShape."""
    fields = {n for n, v in vars(KVShape).items() if isinstance(v, property)}
    view = InstanceView(id="x", role=Role.PREFILL, url="http://x:1", model="m")
    assert len(view.compat_key) == len(fields)
    assert view.compat_key == tuple(getattr(view, f) for f in _KEY_ORDER)
    assert set(_KEY_ORDER) == fields


_KEY_ORDER = ("model", "tp_size", "block_size", "kv_dtype", "kv_layout", "kv_replicated", "transport")

"""Registry rules with an explicit `now`."""

from __future__ import annotations

import pytest
from pdgate.metaserver import registry

from pdgate.models import InstanceLoad, InstanceRegistration, InstanceState, Role, TransportAddress


def reg(role: Role = Role.PREFILL, **kw: object) -> InstanceRegistration:
    data: dict[str, object] = {"id": "i0", "role": role, "url": "http://h:1/", "model": "m"}
    data.update(kw)
    return InstanceRegistration.model_validate(data)


def test_new_instance_takes_the_default_lease_unless_named() -> None:
    inst = registry.new_instance(reg(), now=10, default_lease_s=5)
    assert (inst.lease_s, inst.registered_at, inst.last_heartbeat, inst.state) == (5, 10, 10, InstanceState.READY)
    assert inst.url == "http://h:1"
    assert registry.new_instance(reg(lease_s=2.5), now=10, default_lease_s=5).lease_s == 2.5


def test_liveness_is_the_lease() -> None:
    inst = registry.new_instance(reg(), now=10, default_lease_s=5)
    assert registry.is_live(inst, 15)
    assert not registry.is_live(inst, 15.001)
    renewed = registry.renew(inst, now=14, load=InstanceLoad(running=2))
    assert registry.is_live(renewed, 19) and renewed.load.running == 2
    assert registry.renew(renewed, now=15, load=None).load.running == 2


def test_reregistration_keeps_start_and_drain_only_while_live() -> None:
    first = registry.start_drain(registry.new_instance(reg(), now=10, default_lease_s=5))
    update = registry.new_instance(reg(model="m2"), now=12, default_lease_s=5, existing=first)
    assert (update.registered_at, update.state, update.model) == (10, InstanceState.DRAINING, "m2")
    fresh = registry.new_instance(reg(), now=20, default_lease_s=5, existing=first)
    assert (fresh.registered_at, fresh.state) == (20, InstanceState.READY)


def test_duplicate_tp_rank_addresses_are_refused() -> None:
    addrs = [TransportAddress(tp_rank=1, host="a"), TransportAddress(tp_rank=1, host="b")]
    with pytest.raises(registry.RegistrationInvalid) as err:
        registry.validate(reg(tp_size=2, transport_addresses=addrs))
    assert err.value.field == "transport_addresses[1].tp_rank"
    registry.validate(reg(tp_size=2, transport_addresses=[TransportAddress(tp_rank=0), TransportAddress(tp_rank=1)]))


@pytest.mark.parametrize(
    ("role", "wanted", "hit"),
    [
        (Role.PREFILL, Role.PREFILL, True),
        (Role.BOTH, Role.PREFILL, True),
        (Role.DECODE, Role.PREFILL, False),
        (Role.BOTH, Role.DECODE, True),
        (Role.PREFILL, Role.BOTH, False),
        (Role.BOTH, Role.BOTH, True),
    ],
)
def test_role_filter_includes_both(role: Role, wanted: Role, hit: bool) -> None:
    inst = registry.new_instance(reg(role), now=0, default_lease_s=5)
    assert registry.matches(inst, role=wanted, model=None, state=None) is hit


def test_model_and_state_filters() -> None:
    inst = registry.new_instance(reg(), now=0, default_lease_s=5)
    assert registry.matches(inst, role=None, model="m", state=InstanceState.READY)
    assert not registry.matches(inst, role=None, model="other", state=None)
    assert not registry.matches(inst, role=None, model=None, state=InstanceState.DRAINING)

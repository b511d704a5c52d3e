"""Bug: the router and the connector held two copies of the P/D rule, and they disagreed.

`router/pairing.incompatibility()` accepted a tp=1 prefill with a tp=2 decode for replicated KV over NIXL,
while the decode's connector refused the same pair (`tp_sources(1, 2, True)` raised TPLayoutError): the
router picked a pair that the decode then failed. Both now apply `pdgate.contract`; this test
holds them to it over every TP pair, replication and transport, through each side's own entry point (the
router's pairing and the decode's plan for a KV location).
"""

from __future__ import annotations

import itertools

import pytest
from pdgate.connector.errors import LocationError
from pdgate.connector.location import EngineFacts, plan_for
from pdgate.router.pairing import InstanceView, incompatibility

from pdgate.models import KVLocation, Role, TransportAddress, TransportKind

TPS = (1, 2, 3, 4, 8)
TRANSPORTS = (TransportKind.NIXL, TransportKind.LLMDATADIST)
GRID = list(itertools.product(TPS, TPS, (False, True), TRANSPORTS))


def router_accepts(ptp: int, dtp: int, replicated: bool, transport: TransportKind) -> bool:
    def view(name: str, role: Role, tp: int) -> InstanceView:
        return InstanceView(
            id=name,
            role=role,
            url=f"http://{name}",
            model="m",
            tp_size=tp,
            block_size=16,
            kv_dtype="bf16",
            kv_layout="L",
            kv_replicated=replicated,
            transport=transport,
        )

    return incompatibility(view("p", Role.PREFILL, ptp), view("d", Role.DECODE, dtp)) is None


def connector_sources(ptp: int, dtp: int, replicated: bool, transport: TransportKind) -> tuple[int, ...] | None:
    """The prefill rank each decode rank pulls from, or None when the decode refuses the location."""
    location = KVLocation(
        block_ids=[[5, 6]],
        num_tokens=20,
        tp_size=ptp,
        block_size=16,
        kv_dtype="bf16",
        kv_layout="L",
        transport=transport,
        transport_addresses=[TransportAddress(tp_rank=r, meta={"rank": r}) for r in range(ptp)],
    )
    facts = EngineFacts(
        instance_id="d",
        engine_id="d",
        host=None,
        dp_rank=0,
        tp_size=dtp,
        world_size=dtp,
        block_size=16,
        kv_dtype="bf16",
        kv_layout="L",
        kv_replicated=replicated,
        transport=transport.value,
    )
    try:
        plan = plan_for(location, facts, transfer_id="t", kv_key=1, req_id="r", local_block_ids=[1, 2], hit_blocks=0)
    except LocationError:
        return None
    return tuple(source["rank"] for source in plan.sources)


@pytest.mark.parametrize(("ptp", "dtp", "replicated", "transport"), GRID)
def test_router_and_connector_accept_the_same_pairs(
    ptp: int, dtp: int, replicated: bool, transport: TransportKind
) -> None:
    routed = router_accepts(ptp, dtp, replicated, transport)
    sources = connector_sources(ptp, dtp, replicated, transport)
    assert routed == (sources is not None), f"router {'accepts' if routed else 'refuses'}, the decode disagrees"
    if sources is not None:
        assert sources == tuple(r * ptp // dtp for r in range(dtp))


def test_the_pair_from_the_bug_report_is_served() -> None:
    assert router_accepts(1, 2, True, TransportKind.NIXL)
    assert connector_sources(1, 2, True, TransportKind.NIXL) == (0, 0)  # both decode ranks read the one prefill
    assert not router_accepts(1, 2, True, TransportKind.LLMDATADIST)
    assert connector_sources(1, 2, True, TransportKind.LLMDATADIST) is None

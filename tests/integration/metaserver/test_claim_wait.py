"""`pdgate.claim_wait.claim_handoff` against a real metaserver over HTTP, and the simulator's decode on the
same rule: a handoff another decode holds is refused at once (a decode never waits out another decode's
claim), the router takes back its earlier decode's claim, PENDING waits for READY, and a record that ends
while waited on fails as terminal."""

from __future__ import annotations

import asyncio

import pytest
from pdgate.sim.holds import Holds
from pdgate.sim.ledger import Ledger
from pdgate.sim.settings import Script, SimSettings, Stats
from pdgate.sim.wire import Reject

from pdgate.claim_wait import ClaimRefused, ClaimRule, claim_handoff
from pdgate.contract import KVTransferParams
from pdgate.errors import Code
from pdgate.meta_client import MetaClient
from pdgate.models import Handoff, HandoffCreate, HandoffState, KVLocation, Role
from tests.support.meta import uid

DECODE = ClaimRule(30.0)


async def ready_handoff(client: MetaClient, prefill: str) -> Handoff:
    h = await client.create_handoff(HandoffCreate(prefill_instance_id=prefill))
    loc = KVLocation(block_ids=[[1, 2]], num_tokens=20, block_size=16, engine_id=prefill)
    return await client.mark_ready(h.transfer_id, loc)


async def test_a_decode_refuses_a_handoff_another_decode_holds_at_once(http_client: MetaClient) -> None:
    h = await ready_handoff(http_client, uid("p"))
    # d-1's claim lapses in half a second: a rule that waited for it would claim within the 30 s.
    await http_client.claim(h.transfer_id, "d-1", lease_s=0.5)
    with pytest.raises(ClaimRefused) as refused:
        await claim_handoff(http_client, h.transfer_id, "d-2", rule=DECODE)
    assert refused.value.code is Code.ILLEGAL_TRANSITION and "another decode" in refused.value.message
    assert (await http_client.get_handoff(h.transfer_id)).decode_instance_id == "d-1"


async def test_the_simulators_decode_follows_the_same_rule(http_client: MetaClient, meta_url: str) -> None:
    prefill = uid("p")
    h = await ready_handoff(http_client, prefill)
    await http_client.claim(h.transfer_id, "d-1", lease_s=0.5)
    settings = SimSettings(role="decode", metaserver=meta_url, claim_wait_s=30.0)
    ledger = Ledger(settings, "http://127.0.0.1:1", uid("sim-d"), Role.DECODE, Script(), Stats(1), Holds())
    kv = KVTransferParams(do_remote_prefill=True, transfer_id=h.transfer_id, remote_engine_id=prefill)
    try:
        with pytest.raises(Reject) as rejected:
            await ledger.claim(kv, 0, meta_url)
    finally:
        await ledger.aclose()
    assert rejected.value.status == 409 and rejected.value.code == Code.ILLEGAL_TRANSITION.value
    assert ledger.stats.counts.get("claimed_elsewhere") == 1


async def test_the_router_takes_back_the_claim_of_its_earlier_decode(http_client: MetaClient) -> None:
    h = await ready_handoff(http_client, uid("p"))
    await http_client.claim(h.transfer_id, "d-1", lease_s=30.0)  # would hold it far past the wait below
    rule = ClaimRule(5.0, retry_unavailable=False)
    got = await claim_handoff(http_client, h.transfer_id, "d-2", rule=rule, holder="d-1")
    assert got.state is HandoffState.CLAIMED and got.decode_instance_id == "d-2"


async def test_pending_waits_for_ready_then_claims(http_client: MetaClient) -> None:
    prefill = uid("p")
    h = await http_client.create_handoff(HandoffCreate(prefill_instance_id=prefill))
    waiting = asyncio.ensure_future(claim_handoff(http_client, h.transfer_id, "d-1", rule=DECODE))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await http_client.mark_ready(h.transfer_id, KVLocation(block_ids=[[1]], num_tokens=8, engine_id=prefill))
    got = await waiting
    assert got.state is HandoffState.CLAIMED and got.decode_instance_id == "d-1"


async def test_a_handoff_aborted_while_pending_fails_as_terminal(http_client: MetaClient) -> None:
    h = await http_client.create_handoff(HandoffCreate(prefill_instance_id=uid("p")))
    waiting = asyncio.ensure_future(claim_handoff(http_client, h.transfer_id, "d-1", rule=DECODE))
    await asyncio.sleep(0.2)
    await http_client.abort(h.transfer_id, "client went away")
    with pytest.raises(ClaimRefused) as refused:
        await waiting
    assert refused.value.code is Code.HANDOFF_TERMINAL

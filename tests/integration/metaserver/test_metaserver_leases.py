"""Leases lapse by themselves (the sweeper), with nobody sending a request about the record."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pdgate.meta_client import MetaClient, MetaNotFound
from pdgate.models import HandoffCreate, HandoffState, InstanceRegistration, KVLocation, Role

S = HandoffState
LOC = KVLocation(block_ids=[[1]], num_tokens=16)


async def eventually(check: Any, timeout: float = 15.0) -> Any:
    """Poll `check()` until it returns something truthy (no timed assertion: the bound only stops a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def test_instance_vanishes_when_its_heartbeat_lease_lapses(serve_meta: Any) -> None:
    url = serve_meta().url
    async with MetaClient(url) as meta:
        await meta.register(
            InstanceRegistration(id="short", role=Role.PREFILL, url="http://h:1", model="m", lease_s=0.3)
        )
        await meta.register(InstanceRegistration(id="long", role=Role.DECODE, url="http://h:2", model="m", lease_s=60))
        assert {i.id for i in await meta.list_instances()} == {"short", "long"}

        async def gone() -> bool:
            return [i.id for i in await meta.list_instances()] == ["long"]

        await eventually(gone)
        with pytest.raises(MetaNotFound):
            await meta.get_instance("short")
        with pytest.raises(MetaNotFound):
            await meta.heartbeat("short")  # the instance must register again
        await meta.register(InstanceRegistration(id="short", role=Role.PREFILL, url="http://h:1", model="m"))
        assert {i.id for i in await meta.list_instances()} == {"short", "long"}


async def test_unclaimed_ready_handoff_expires_and_the_prefill_hears_it(serve_meta: Any) -> None:
    url = serve_meta().url
    async with MetaClient(url) as meta:
        h = await meta.create_handoff(HandoffCreate(prefill_instance_id="p-exp", lease_s=0.3))
        feed = await meta.events("p-exp")
        await meta.mark_ready(h.transfer_id, LOC)
        # The prefill long-polls its feed; nobody touches the handoff.
        got = await meta.events("p-exp", cursor=feed.cursor, wait=30)
        assert [(e.transfer_id, e.state, e.reason) for e in got.events] == [
            (h.transfer_id, S.EXPIRED, "READY lease lapsed")
        ]
        assert (await meta.get_handoff(h.transfer_id)).state is S.EXPIRED


async def test_pending_handoff_expires(serve_meta: Any) -> None:
    url = serve_meta(pending_lease_s=0.3).url
    async with MetaClient(url) as meta:
        h = await meta.create_handoff(HandoffCreate(prefill_instance_id="p-pend"))
        # A long-poll waiting for READY learns that the record left PENDING by expiring.
        rec = await meta.get_handoff(h.transfer_id, wait=30)
        assert rec.state is S.EXPIRED and rec.reason == "PENDING lease lapsed"
        events = await meta.events("p-pend")
        assert [(e.transfer_id, e.state) for e in events.events] == [(h.transfer_id, S.EXPIRED)]


async def test_a_lapsed_claim_lets_another_decode_claim(serve_meta: Any) -> None:
    url = serve_meta(max_claims=2).url
    async with MetaClient(url) as meta:
        h = await meta.create_handoff(HandoffCreate(prefill_instance_id="p-claim"))
        await meta.mark_ready(h.transfer_id, LOC)
        await meta.claim(h.transfer_id, "d-dead", lease_s=0.3)

        async def ready_again() -> bool:
            return (await meta.get_handoff(h.transfer_id)).state is S.READY

        await eventually(ready_again)
        second = await meta.claim(h.transfer_id, "d-alive", lease_s=30)
        assert second.claims == 2 and second.decode_instance_id == "d-alive"
        assert (await meta.done(h.transfer_id, "d-alive")).state is S.DONE
        assert [e.state for e in (await meta.events("p-claim")).events] == [S.DONE]

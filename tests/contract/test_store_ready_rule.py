"""The store contract, READY by the handoff's own prefill (`ledger.check_ready`), on every backend.

Each store holds the rule in the move's own step: the memory store under its lock, one Redis inside
move.lua (`check_ready` in _lib.lua, reading the prefill's registry hash), a Redis Cluster with reads
before the move. The same cases run on each; the service turns the refusal into today's errors (403 for
the engine token, 422 naming `body.engine_id`), on a single call and in a batch item alike.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from pdgate.metaserver import errors, ledger
from pdgate.metaserver.batch import parse_batch, run_batch
from pdgate.metaserver.guards import Forbidden
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store import Store

from pdgate.models import KVLocation
from tests.contract.conftest import MakeStore
from tests.contract.records import LOC, S, create, reg, register, t0
from tests.support.redis import RedisServer

ANY = LOC.model_copy(update={"engine_id": None})


def loc(engine_id: str | None) -> KVLocation:
    return LOC.model_copy(update={"engine_id": engine_id})


async def test_an_engine_token_marks_ready_only_its_own_prefills_handoffs(store: Store) -> None:
    now = t0()
    await create(store, "e1", now, prefill="p0")
    with pytest.raises(ledger.NotItsPrefill) as refused:
        await store.mark_ready("e1", ANY, now=now, engine="p1")
    assert (refused.value.rule, refused.value.prefill_instance_id) == ("engine", "p0")
    assert (await store.get_handoff("e1")).state is S.PENDING  # type: ignore[union-attr]
    assert (await store.mark_ready("e1", ANY, now=now, engine="p0")).handoff.state is S.READY


# (the prefill's registration: None = not registered, else its engine_id; the location's engine_id;
#  the engine_id the refusal names, None = READY)
CASES = [
    pytest.param("eng-p0", "eng-p1", "eng-p0", id="another-engine"),
    pytest.param("eng-p0", "eng-p0", None, id="its-engine"),
    pytest.param(None, "eng-p1", None, id="prefill-not-registered"),
    pytest.param("", "eng-p1", "", id="registered-empty-engine-id"),
    pytest.param("eng-p0", "", "eng-p0", id="location-empty-engine-id"),
]


@pytest.mark.parametrize(("registered", "stated", "refusal"), CASES)
async def test_a_location_names_the_engine_its_prefill_registered(
    store: Store, registered: str | None, stated: str, refusal: str | None
) -> None:
    now = t0()
    if registered is not None:
        await register(store, reg("p0", engine_id=registered), now)
    await register(store, reg("p1", engine_id="eng-p1"), now)
    await create(store, "e2", now, prefill="p0")
    if refusal is None:
        assert (await store.mark_ready("e2", loc(stated), now=now + 1)).handoff.state is S.READY
        return
    with pytest.raises(ledger.NotItsPrefill) as refused:
        await store.mark_ready("e2", loc(stated), now=now + 1)
    assert (refused.value.rule, refused.value.prefill_instance_id, refused.value.registered) == (
        "engine_id",
        "p0",
        refusal,
    )
    assert (await store.get_handoff("e2")).state is S.PENDING  # type: ignore[union-attr]


async def test_no_engine_id_stated_and_no_engine_id_registered_pass(store: Store) -> None:
    now = t0()
    await register(store, reg("p0", engine_id=None), now)
    await create(store, "a", now)
    await create(store, "b", now)
    assert (await store.mark_ready("a", loc("anything"), now=now)).handoff.state is S.READY
    await register(store, reg("p0", engine_id="eng-p0"), now)
    assert (await store.mark_ready("b", ANY, now=now)).handoff.state is S.READY


async def test_a_prefill_counts_until_the_last_instant_of_its_lease(store: Store) -> None:
    now = t0()
    await register(store, reg("p0", engine_id="eng-p0"), now, lease=10.0)
    await create(store, "live", now)
    await create(store, "lapsed", now)
    with pytest.raises(ledger.NotItsPrefill):
        await store.mark_ready("live", loc("eng-p1"), now=now + 10.0)
    assert (await store.mark_ready("lapsed", loc("eng-p1"), now=now + 10.5)).handoff.state is S.READY


async def test_the_rule_comes_after_not_found_and_before_the_state(store: Store) -> None:
    now = t0()
    await register(store, reg("p0", engine_id="eng-p0"), now)
    with pytest.raises(errors.HandoffNotFound):
        await store.mark_ready("nope", loc("eng-p1"), now=now, engine="p1")
    await create(store, "gone", now)
    await store.abort("gone", "client left", now=now)
    with pytest.raises(ledger.NotItsPrefill) as refused:  # engine rule first, then engine_id, then the state
        await store.mark_ready("gone", loc("eng-p1"), now=now, engine="p1")
    assert refused.value.rule == "engine"
    with pytest.raises(ledger.NotItsPrefill) as refused:
        await store.mark_ready("gone", loc("eng-p1"), now=now, engine="p0")
    assert refused.value.rule == "engine_id"
    with pytest.raises(ledger.IllegalTransition):
        await store.mark_ready("gone", loc("eng-p0"), now=now, engine="p0")


async def test_the_service_answers_each_rule_with_its_error_on_a_route_and_in_a_batch(store: Store) -> None:
    svc = MetaService(store, MetaSettings())
    await register(store, reg("p0", engine_id="eng-p0"), svc.clock())
    await create(store, "s1", svc.clock())
    with pytest.raises(Forbidden) as forbidden:
        await svc.mark_ready("s1", loc("eng-p0"), engine="p1")
    assert str(forbidden.value) == "an engine token for p1 cannot mark READY a handoff of prefill p0"
    with pytest.raises(errors.InvalidInput) as invalid:
        await svc.mark_ready("s1", loc("eng-p1"))
    assert str(invalid.value) == ("body.engine_id: 'eng-p1' is not the engine of this handoff's prefill p0 ('eng-p0')")
    item = b'{"op":"ready","transfer_id":"s1","location":%s}'
    out = await run_batch(
        svc, parse_batch(b'{"items":[%s]}' % (item % loc("eng-p0").model_dump_json().encode())), engine="p1"
    )
    assert isinstance(out[0], Forbidden) and str(out[0]) == str(forbidden.value)
    out = await run_batch(svc, parse_batch(b'{"items":[%s]}' % (item % loc("eng-p1").model_dump_json().encode())))
    assert isinstance(out[0], errors.InvalidInput) and str(out[0]) == str(invalid.value)
    assert (await svc.mark_ready("s1", loc("eng-p0"), engine="p0")).state is S.READY


@pytest.mark.parametrize("store_kind", ["redis"])
async def test_on_one_redis_the_checked_ready_is_one_script_call_and_no_read(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    """The point of moving the rule into move.lua: no HGETALL of the record or the instance first."""
    store = make_store()
    svc = MetaService(store, MetaSettings())
    await register(store, reg("p0", engine_id="eng-p0"), svc.clock())
    for tid in ("warm", "counted"):
        await create(store, tid, svc.clock())
    await svc.mark_ready("warm", loc("eng-p0"), engine="p0")  # the move script is loaded by now
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    try:
        before = await client.info("commandstats")
        await svc.mark_ready("counted", loc("eng-p0"), engine="p0")
        after = await client.info("commandstats")
    finally:
        await client.aclose()

    def calls(info: dict[str, dict[str, int]], command: str) -> int:
        return int(info.get(f"cmdstat_{command}", {}).get("calls", 0))

    assert calls(after, "evalsha") - calls(before, "evalsha") == 1
    # commandstats counts a script's own commands too: one HGETALL is move.lua's reply; the record and
    # the instance read before the move were two more
    assert calls(after, "hgetall") - calls(before, "hgetall") == 1

"""MetaService's ledger moves on the memory store: the per-pair transition counters stay exact across
many moves (the service keeps each pair's counter child), refused moves count nothing."""

from __future__ import annotations

import pytest
from pdgate.metaserver import errors
from pdgate.metaserver.service import MetaService
from pdgate.metaserver.settings import MetaSettings
from pdgate.metaserver.store.memory import MemoryStore

from pdgate.models import HandoffCreate, KVLocation


def _count(svc: MetaService, before: str, after: str) -> float:
    value = svc.metrics.registry.get_sample_value(
        "pdgate_metaserver_handoff_transitions_total", {"from_state": before, "to_state": after}
    )
    return value or 0.0


async def test_each_move_is_counted_once_under_its_pair_and_refusals_are_not() -> None:
    svc = MetaService(MemoryStore(), MetaSettings())
    loc = KVLocation(block_ids=[[1, 2]], num_tokens=16)
    for n in range(3):
        rec = await svc.create_handoff(HandoffCreate(prefill_instance_id="p1", transfer_id=f"t{n}"))
        await svc.mark_ready(rec.transfer_id, loc)
        await svc.claim(rec.transfer_id, "d1")
        with pytest.raises(errors.IllegalState):  # another decode: refused, typed, not counted
            await svc.claim(rec.transfer_id, "d2")
        await svc.claim(rec.transfer_id, "d1")  # the holder renewing its lease: no state change, no count
        await svc.done(rec.transfer_id, "d1")
        assert _count(svc, "PENDING", "READY") == n + 1
        assert _count(svc, "READY", "CLAIMED") == n + 1
        assert _count(svc, "CLAIMED", "DONE") == n + 1
        assert _count(svc, "CLAIMED", "CLAIMED") == 0
    with pytest.raises(errors.HandoffTerminal):
        await svc.abort("t0", "late")
    assert _count(svc, "DONE", "ABORTED") == 0

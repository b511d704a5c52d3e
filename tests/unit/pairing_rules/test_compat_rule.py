"""pdgate.pairing: the one P/D compatibility rule (fields, TP layouts, wildcards)."""

from __future__ import annotations

import pytest

from pdgate.models import TransportKind
from pdgate.pairing import KVFacts, Mismatch, mismatch, source_rank, tp_mismatch

NIXL, LLMDD = TransportKind.NIXL, TransportKind.LLMDATADIST
P = KVFacts(model="m", block_size=16, kv_dtype="bf16", kv_layout="L", transport=NIXL, tp_size=2)


def test_identical_shapes_match() -> None:
    assert mismatch(P, P) is None


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"model": "x"}, "d1 serves model x, p1 serves m"),
        ({"block_size": 32}, "d1 has block_size 32, p1 has 16"),
        ({"kv_dtype": "fp8"}, "d1 has kv_dtype fp8, p1 has bf16"),
        ({"kv_layout": "HND"}, "d1 has kv_layout 'HND', p1 has 'L'"),
        ({"transport": LLMDD}, "d1 uses transport llmdatadist, p1 uses nixl"),
        ({"tp_size": 1}, "d1 has tp 1, p1 has tp 2 and its KV is not replicated"),
    ],
)
def test_each_field_is_named(change: dict[str, object], sentence: str) -> None:
    d = KVFacts(**{**P.__dict__, **change})  # type: ignore[arg-type]
    found = mismatch(P, d)
    assert found is not None and found.describe("p1", "d1") == sentence


def test_unstated_fields_match_anything() -> None:
    assert mismatch(P, KVFacts()) is None
    assert mismatch(KVFacts(), P) is None
    assert mismatch(P, KVFacts(kv_layout="")) == Mismatch("kv_layout", "L", "")  # "" is a value, None is not


@pytest.mark.parametrize("transport", [NIXL, LLMDD, TransportKind.SIM, None])
def test_replicated_kv_with_a_larger_prefill_pairs_on_every_transport(transport: TransportKind | None) -> None:
    assert tp_mismatch(4, 2, kv_replicated=True, transport=transport) is None
    assert [source_rank(r, 4, 2) for r in range(2)] == [0, 2]


def test_replicated_kv_with_a_larger_decode_needs_a_one_sided_transport() -> None:
    assert tp_mismatch(1, 2, kv_replicated=True, transport=NIXL) is None
    assert [source_rank(r, 1, 2) for r in range(2)] == [0, 0]
    assert [source_rank(r, 2, 4) for r in range(4)] == [0, 0, 1, 1]
    refused = tp_mismatch(1, 2, kv_replicated=True, transport=LLMDD)
    assert refused is not None and "llmdatadist needs P tp >= D tp" in refused.describe()


def test_sharded_kv_needs_equal_tp() -> None:
    assert tp_mismatch(2, 2, kv_replicated=False, transport=LLMDD) is None
    assert [source_rank(r, 3, 3) for r in range(3)] == [0, 1, 2]
    for ptp, dtp in ((4, 2), (1, 2)):
        refused = tp_mismatch(ptp, dtp, kv_replicated=False, transport=NIXL)
        assert refused is not None and "not replicated" in refused.describe()


def test_the_prefills_replication_flag_decides() -> None:
    p = KVFacts(tp_size=4, kv_replicated=True, transport=NIXL)
    assert mismatch(p, KVFacts(tp_size=2)) is None
    assert mismatch(KVFacts(tp_size=4, transport=NIXL), KVFacts(tp_size=2, kv_replicated=True)) is not None


def test_a_registration_that_omits_kv_dtype_and_layout_pairs_with_a_resolved_engine() -> None:
    """The registration defaults were "auto" and "": values, not "any", so an engine registered without them
    never paired with a connector that resolved its dtype to bfloat16 and stated its layout tag."""
    from pdgate.models import InstanceRegistration

    bare = InstanceRegistration(id="p1", role="prefill", url="http://10.0.0.1:8000", model="m", transport=NIXL)
    assert bare.kv_dtype is None and bare.kv_layout is None
    connector = KVFacts(model="m", block_size=16, kv_dtype="bfloat16", kv_layout="NHD-h8", transport=NIXL, tp_size=1)
    assert mismatch(bare, connector) is None
    assert mismatch(connector, bare) is None
    stated = bare.model_copy(update={"kv_dtype": "fp8"})
    assert mismatch(stated, connector) == Mismatch("kv_dtype", "fp8", "bfloat16")  # a stated value still counts


def test_pdgate_contract_still_exports_the_rule_itself() -> None:
    """The rule moved to pdgate.pairing; its importers through pdgate.contract get the same objects."""
    from pdgate import contract, pairing

    for name in pairing.__all__:
        assert getattr(contract, name) is getattr(pairing, name) and name in contract.__all__

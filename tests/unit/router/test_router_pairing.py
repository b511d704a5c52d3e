"""pairing.py: which decode can take which prefill's KV, and the sentence when none can."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pdgate.router.pairing import InstanceView, compatible, explain, incompatibility

from pdgate.models import Role, TransportKind

P = InstanceView(
    id="p1", role=Role.PREFILL, url="http://p1", model="m", tp_size=2, block_size=16, kv_dtype="auto",
    kv_layout="", transport=TransportKind.NIXL,
)  # fmt: skip
D = replace(P, id="d1", role=Role.DECODE, url="http://d1")


def test_identical_shapes_pair() -> None:
    assert incompatibility(P, D) is None and compatible(P, D)
    assert not compatible(P, replace(D, block_size=32))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model": "other"}, "serves model other"),
        ({"block_size": 32}, "d1 has block_size 32, p1 has 16"),
        ({"kv_dtype": "fp8"}, "kv_dtype fp8"),
        ({"kv_layout": "HND"}, "kv_layout 'HND'"),
        ({"transport": TransportKind.LLMDATADIST}, "transport llmdatadist"),
        ({"tp_size": 1}, "tp 1, p1 has tp 2 and its KV is not replicated"),
    ],
)
def test_each_mismatch_is_named(change: dict, needle: str) -> None:
    why = incompatibility(P, replace(D, **change))
    assert why is not None and needle in why


def test_missing_fields_are_wildcards() -> None:
    static = InstanceView(id="s", role=Role.DECODE, url="http://s", model="m")
    assert incompatibility(P, static) is None
    assert incompatibility(replace(P, model=None), D) is None


def test_replicated_kv_lets_a_smaller_decode_pull() -> None:
    p = replace(P, kv_replicated=True, tp_size=4)
    assert incompatibility(p, replace(D, tp_size=2)) is None
    assert incompatibility(p, replace(D, tp_size=8)) is None  # NIXL: any TP
    p_ld = replace(p, transport=TransportKind.LLMDATADIST)
    d_ld = replace(D, transport=TransportKind.LLMDATADIST)
    assert incompatibility(p_ld, replace(d_ld, tp_size=2)) is None
    why = incompatibility(p_ld, replace(d_ld, tp_size=8))
    assert why is not None and "P tp >= D tp" in why


def test_explain_says_why_no_pair_fits() -> None:
    d16 = replace(D, block_size=32)
    text = explain("m", [P], [d16])
    assert "no compatible prefill/decode pair for model m" in text and "d1 has block_size 32, p1 has 16" in text
    assert explain("x", [P], [D]) == "no prefill or decode instance serves model x"
    assert "no decode instance serves model m" in explain("m", [P], [])
    assert "no prefill instance serves model m" in explain("m", [], [D])
    down = explain("m", [P], [D], [(D, "is draining")])
    assert "d1 is draining" in down

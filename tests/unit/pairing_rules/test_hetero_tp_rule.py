"""The pairing rule for sharded (GQA) KV at unequal TP (`pdgate.pairing`): the KV head count read from the
`kv_layout` tags, and when `tp_mismatch` admits the pair (one TP a multiple of the other, whole heads on
both, a transport in `SUB_BLOCK_TRANSPORTS`) or refuses it with the reason. The router (`incompatibility`)
and the decode's location check (`plan_for`) both go through `mismatch`, so both see these answers.
"""

from __future__ import annotations

import pytest
from pdgate.connector.registration import kv_layout_tag
from pdgate.connector.transport import transport_class
from pdgate.router.pairing import InstanceView, incompatibility

from pdgate import pairing
from pdgate.models import Role, TransportKind
from pdgate.pairing import KVFacts, layout_kv_heads, mismatch, total_kv_heads, tp_mismatch


def tag(heads_per_rank: int) -> str:
    """The connector's tag for the tiny model's shape with this many KV heads on each rank."""
    return kv_layout_tag(
        layout="NHD", dtype="bfloat16", num_kv_heads=heads_per_rank, head_size=32, block_size=32, num_layers=2
    )


def side(tp: int, heads_per_rank: int, transport: TransportKind = TransportKind.NIXL) -> KVFacts:
    return KVFacts(
        model="m", block_size=32, kv_dtype="bfloat16", kv_layout=tag(heads_per_rank), transport=transport, tp_size=tp
    )


def test_the_tag_names_the_heads_per_rank() -> None:
    assert layout_kv_heads(tag(4)) == ("NHD/bfloat16/L2/H/D32/B32", 4)
    assert layout_kv_heads("L") is None  # a layout string the connector did not write
    assert layout_kv_heads("NHD/bfloat16/L2/H0/D32/B32") is None  # the engine did not know its heads
    assert layout_kv_heads(None) is None


@pytest.mark.parametrize(
    ("p", "d", "want"),
    [
        ((1, 2), (2, 1), 2),  # the tiny model (2 KV heads): prefill tp 2, decode tp 1
        ((2, 1), (1, 2), 2),
        ((2, 4), (4, 2), 8),  # 8 heads: tp 4 -> tp 2
        ((4, 2), (2, 4), 8),
        ((1, 4), (1, 2), None),  # one head per rank on both sides at tp > 1: 1 or 2 heads, replicated or not
        ((3, 2), (2, 1), None),  # the two sides name different models
    ],
)
def test_total_heads_come_from_both_tags(p: tuple[int, int], d: tuple[int, int], want: int | None) -> None:
    assert total_kv_heads(tag(p[0]), p[1], tag(d[0]), d[1]) == want


def test_tags_differing_in_heads_at_equal_tp_are_two_layouts() -> None:
    found = mismatch(side(2, 1), side(2, 2))
    assert found is not None and found.field == "kv_layout"


def test_sharded_unequal_tp_is_refused_until_a_transport_runs_sub_block_reads() -> None:
    found = mismatch(side(2, 1), side(1, 2))  # the tiny model, P tp 2 -> D tp 1, over NIXL
    assert found is not None and found.field == "tp_size"
    assert found.describe() == (
        "the decode has tp 1, the prefill has tp 2 and its KV is not replicated: re-cutting its KV heads "
        "needs sub-block reads, which nixl does not run here"
    )


@pytest.fixture
def nixl_reads_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the rule will stand once the NIXL adapter executes `PullRequest.ranges`."""
    monkeypatch.setattr(pairing, "SUB_BLOCK_TRANSPORTS", frozenset({TransportKind.NIXL}))


@pytest.mark.usefixtures("nixl_reads_ranges")
@pytest.mark.parametrize(("p", "d"), [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((4, 2), (2, 4)), ((2, 4), (4, 2))])
def test_a_sub_block_transport_takes_sharded_unequal_tp(p: tuple[int, int], d: tuple[int, int]) -> None:
    assert mismatch(side(p[1], p[0]), side(d[1], d[0])) is None


@pytest.mark.usefixtures("nixl_reads_ranges")
def test_heads_that_cannot_be_recut_whole_are_refused_with_the_count() -> None:
    # 6 KV heads: 2 per rank at tp 3, 3 per rank at tp 2; neither TP divides the other.
    found = mismatch(side(3, 2), side(2, 3))
    assert found is not None and "its 6 KV heads cannot be re-cut whole" in found.describe()


@pytest.mark.usefixtures("nixl_reads_ranges")
def test_llm_datadist_reads_whole_blocks_only() -> None:
    found = mismatch(side(2, 1, TransportKind.LLMDATADIST), side(1, 2, TransportKind.LLMDATADIST))
    assert found is not None and "which llmdatadist does not run here" in found.describe()


@pytest.mark.usefixtures("nixl_reads_ranges")
def test_an_unknown_head_count_keeps_the_old_refusal() -> None:
    # One head per rank on both sides (tp 4 -> tp 2): the heads may be replicated, so nothing is re-cut.
    assert mismatch(side(4, 1), side(2, 1)) == pairing.Mismatch("tp_size", 4, 2)
    assert tp_mismatch(4, 2, kv_replicated=False, transport=TransportKind.NIXL) == pairing.Mismatch("tp_size", 4, 2)


@pytest.mark.usefixtures("nixl_reads_ranges")
def test_the_router_pairs_what_the_rule_admits() -> None:
    def view(name: str, role: Role, tp: int, heads: int) -> InstanceView:
        return InstanceView(
            id=name, role=role, url=f"http://{name}", model="m", tp_size=tp, block_size=32,
            kv_dtype="bfloat16", kv_layout=tag(heads), transport=TransportKind.NIXL,
        )  # fmt: skip

    assert incompatibility(view("p", Role.PREFILL, 2, 1), view("d", Role.DECODE, 1, 2)) is None
    refused = incompatibility(view("p", Role.PREFILL, 3, 2), view("d", Role.DECODE, 2, 3))
    assert refused is not None and refused.startswith("d has tp 2, p has tp 3")


@pytest.mark.parametrize("kind", [k for k in TransportKind if k is not TransportKind.SIM])
def test_the_rule_lists_exactly_the_adapters_that_run_sub_block_reads(kind: TransportKind) -> None:
    # A kind admitted before its adapter honours `PullRequest.ranges` would fail every request sent to it.
    assert transport_class(kind.value).sub_block is (kind in pairing.SUB_BLOCK_TRANSPORTS)

"""The rank tables Ascend users already have are read as they are (fixtures/*.json).

* `ascend_pr684_global_ranktable.json`: the global rank table of vllm-ascend's first llm_datadist
  connector (MindCluster's server_group_list). Its group 0 is the proxy host, given by `server_ip` and
  `container_ip` only, with no server_id and no devices; each server's rank ids start at 0.
* `vllm_ascend_gen_ranktable_{a2,a3}.json`: what vllm-ascend's examples/disaggregated_prefill_v1/
  gen_ranktable.py writes: flat prefill/decode device lists with the table's own cluster ids, version
  "1.2" on A2 too, and the super pod fields per device on A3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdgate.connector.errors import RankTableError
from pdgate.connector.ranktable import FORM_DEVICE_LISTS, FORM_GROUPS, GroupRole, assign_ranks, dump_rank_table
from pdgate.connector.ranktable_cli import main
from pdgate.connector.ranktable_parse import load_rank_table, parse_rank_table

FIXTURES = Path(__file__).parent / "fixtures"
PR684 = FIXTURES / "ascend_pr684_global_ranktable.json"
GEN_A2 = FIXTURES / "vllm_ascend_gen_ranktable_a2.json"
GEN_A3 = FIXTURES / "vllm_ascend_gen_ranktable_a3.json"


@pytest.mark.parametrize("path", [PR684, GEN_A2, GEN_A3], ids=lambda p: p.stem)
def test_validate_accepts_the_table(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(path), "--show"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"OK {path}")


@pytest.mark.parametrize("path", [PR684, GEN_A2, GEN_A3], ids=lambda p: p.stem)
def test_the_canonical_form_keeps_the_shape_and_reads_back_equal(path: Path) -> None:
    table = load_rank_table(path)
    dumped = json.loads(json.dumps(dump_rank_table(table)))
    assert parse_rank_table(dumped) == table
    assert ("server_group_list" in dumped) == (table.form == FORM_GROUPS)


def test_the_proxy_host_needs_only_its_address() -> None:
    table = load_rank_table(PR684)
    assert table.form == FORM_GROUPS and not table.is_a3
    router = table.router
    assert router is not None
    assert (router.server_id, router.server_ip, router.container_ip, router.devices) == (
        None,
        "192.0.2.10",
        "192.0.2.10",
        (),
    )
    placements = assign_ranks(table, prefill_tp=4, decode_tp=4)
    prefill = [(p.server_id, p.dp_rank, p.tp_rank, p.cluster_id) for p in placements if p.role is GroupRole.PREFILL]
    assert prefill[4] == ("server-1", 0, 0, 4)  # server-1's rank ids restart at 0; its devices follow server-0's
    decode = [p for p in placements if p.role is GroupRole.DECODE]
    assert [p.cluster_id for p in decode] == [8, 9, 10, 11]


def test_the_proxy_host_still_needs_an_address() -> None:
    data = json.loads(PR684.read_text())
    del data["server_group_list"][0]["server_list"][0]["server_ip"]
    with pytest.raises(RankTableError) as info:
        parse_rank_table(data)
    assert info.value.path == "server_group_list[0].server_list[0].server_ip"


def test_gen_ranktable_a2_splits_one_host_and_keeps_its_cluster_ids() -> None:
    table = load_rank_table(GEN_A2)
    assert table.form == FORM_DEVICE_LISTS and not table.is_a3 and table.router is None
    placements = assign_ranks(table, prefill_tp=2, decode_tp=1)
    got = [(p.role, p.server_id, p.device_id, p.dp_rank, p.tp_rank, p.cluster_id) for p in placements]
    assert got == [
        (GroupRole.PREFILL, "192.0.2.21", 0, 0, 0, 1),
        (GroupRole.PREFILL, "192.0.2.21", 1, 0, 1, 2),
        (GroupRole.DECODE, "192.0.2.21", 2, 0, 0, 3),
        (GroupRole.DECODE, "192.0.2.21", 3, 1, 0, 4),
    ]
    assert placements[0].server_ip == "192.0.2.21" and placements[0].rank_id is None


def test_gen_ranktable_a3_builds_the_super_pods() -> None:
    table = load_rank_table(GEN_A3)
    assert table.is_a3
    placements = assign_ranks(table, prefill_tp=1, decode_tp=2)
    assert {(p.super_pod_id, p.super_device_id) for p in placements if p.role is GroupRole.DECODE} == {
        ("0", 16),
        ("0", 17),
    }


@pytest.mark.parametrize(
    ("change", "path", "reason"),
    [
        (lambda t: t["decode_device_list"][0].update(cluster_id="1"), "decode_device_list[0].cluster_id", "duplicate"),
        (lambda t: t["prefill_device_list"][1].pop("cluster_id"), "prefill_device_list[1].cluster_id", "missing"),
        (lambda t: t["prefill_device_list"][1].update(device_id="0"), "prefill_device_list[1].device_id", "duplicate"),
        (lambda t: t.pop("decode_device_list"), "decode_device_list", "missing"),
        (
            lambda t: t["decode_device_list"][0].update(device_ip="198.51.100.21"),
            "decode_device_list (server '192.0.2.21' device 2).device_ip",
            "is also used by",
        ),
    ],
)
def test_gen_ranktable_faults_are_named(change, path: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(GEN_A2.read_text())
    change(data)
    with pytest.raises(RankTableError) as info:
        parse_rank_table(data)
    assert info.value.path == path and reason in info.value.reason


def test_gen_ranktable_a3_needs_one_super_pod_per_server() -> None:
    data = json.loads(GEN_A3.read_text())
    data["decode_device_list"][1]["super_pod_id"] = "1"
    with pytest.raises(RankTableError, match="is in super pod '0'"):
        parse_rank_table(data)
    data = json.loads(GEN_A3.read_text())
    del data["prefill_device_list"][0]["super_device_id"]
    with pytest.raises(RankTableError, match="super_device_id: missing"):
        parse_rank_table(data)

"""Global rank table: parse, validate (faults named by path), derive ranks, canonical form."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pdgate.connector.errors import RankTableError
from pdgate.connector.ranktable import GroupRole, assign_ranks, dump_rank_table, find_placement
from pdgate.connector.ranktable_parse import parse_rank_table


def a2_table() -> dict[str, Any]:
    return {
        "version": "1.0",
        "status": "completed",
        "server_group_list": [
            {"group_id": "0", "server_list": [{"server_id": "10.0.0.9", "server_ip": "10.0.0.9"}]},
            {
                "group_id": "1",
                "server_count": "2",
                "server_list": [
                    {
                        "server_id": "10.0.0.1",
                        "server_ip": "10.0.0.1",
                        "device": [
                            {"device_id": "1", "device_ip": "192.168.1.2", "rank_id": "1"},
                            {"device_id": "0", "device_ip": "192.168.1.1", "rank_id": "0"},
                        ],
                    },
                    {
                        "server_id": "10.0.0.2",
                        "server_ip": "10.0.0.2",
                        "device": [
                            {"device_id": "0", "device_ip": "192.168.2.1", "rank_id": "2"},
                            {"device_id": "1", "device_ip": "192.168.2.2", "rank_id": "3"},
                        ],
                    },
                ],
            },
            {
                "group_id": "2",
                "server_list": [
                    {
                        "server_id": "10.0.0.3",
                        "server_ip": "10.0.0.3",
                        "device": [
                            {"device_id": "0", "device_ip": "192.168.3.1", "rank_id": "0"},
                            {"device_id": "1", "device_ip": "192.168.3.2", "rank_id": "1"},
                        ],
                    }
                ],
            },
        ],
    }


def a3_table() -> dict[str, Any]:
    t = a2_table()
    t["version"] = "1.2"
    for group in t["server_group_list"][1:]:
        sdid = 0
        for server in group["server_list"]:
            for dev in server["device"]:
                dev["super_device_id"] = str(sdid)
                sdid += 1
        group["super_pod_list"] = [
            {"super_pod_id": "0", "server_list": [{"server_id": s["server_id"]} for s in group["server_list"]]}
        ]
    return t


# ---------------------------------------------------------------- parsing and derivation


def test_parses_a2_table() -> None:
    table = parse_rank_table(a2_table())
    assert not table.is_a3
    assert table.router is not None and table.router.server_ip == "10.0.0.9"
    prefill = table.group(GroupRole.PREFILL)
    assert prefill is not None and [s.server_id for s in prefill.servers] == ["10.0.0.1", "10.0.0.2"]
    assert prefill.servers[0].devices[0].device_id == 1  # file order is kept; sorting is for ranks


def test_assign_ranks_sorts_by_device_id_and_numbers_clusters_prefill_first() -> None:
    table = parse_rank_table(a2_table())
    placements = assign_ranks(table, prefill_tp=2, decode_tp=1)
    got = [(p.role, p.server_id, p.device_id, p.dp_rank, p.tp_rank, p.cluster_id) for p in placements]
    assert got == [
        (GroupRole.PREFILL, "10.0.0.1", 0, 0, 0, 0),
        (GroupRole.PREFILL, "10.0.0.1", 1, 0, 1, 1),
        (GroupRole.PREFILL, "10.0.0.2", 0, 0, 0, 2),
        (GroupRole.PREFILL, "10.0.0.2", 1, 0, 1, 3),
        (GroupRole.DECODE, "10.0.0.3", 0, 0, 0, 4),
        (GroupRole.DECODE, "10.0.0.3", 1, 1, 0, 5),
    ]
    p = find_placement(placements, GroupRole.DECODE, "10.0.0.3", 1, 0)
    assert (p.device_ip, p.cluster_id) == ("192.168.3.2", 5)
    with pytest.raises(RankTableError, match=r"no prefill device on server '10\.0\.0\.3'"):
        find_placement(placements, GroupRole.PREFILL, "10.0.0.3", 0, 0)


def test_group_order_in_file_does_not_change_cluster_ids() -> None:
    t = a2_table()
    t["server_group_list"].reverse()
    ids = {
        (p.role, p.server_id, p.device_id): p.cluster_id
        for p in assign_ranks(parse_rank_table(t), prefill_tp=1, decode_tp=1)
    }
    assert ids[(GroupRole.PREFILL, "10.0.0.1", 0)] == 0
    assert ids[(GroupRole.DECODE, "10.0.0.3", 1)] == 5


def test_tp_must_divide_each_server() -> None:
    with pytest.raises(RankTableError) as err:
        assign_ranks(parse_rank_table(a2_table()), prefill_tp=4, decode_tp=1)
    assert err.value.path == "server_group_list[1].server_list[0].device"
    assert "2 devices do not divide into prefill tp=4" in str(err.value)


def test_a3_table_and_super_pods() -> None:
    table = parse_rank_table(a3_table())
    assert table.is_a3
    placements = assign_ranks(table, prefill_tp=1, decode_tp=1)
    assert {p.super_pod_id for p in placements} == {"0"}
    assert (placements[0].device_id, placements[0].super_device_id) == (0, 1)  # file listed device 1 first


def test_numbers_may_be_ints_on_input() -> None:
    t = a2_table()
    t["server_group_list"][2]["server_list"][0]["device"][0]["device_id"] = 0
    t["server_group_list"][2]["server_list"][0]["device"][0]["rank_id"] = 0
    assert parse_rank_table(t).group(GroupRole.DECODE).servers[0].devices[0].device_id == 0  # type: ignore[union-attr]


def test_rank_ids_may_restart_in_each_server() -> None:
    t = a2_table()
    for i, dev in enumerate(t[G][1]["server_list"][1]["device"]):
        dev["rank_id"] = str(i)  # as vllm-ascend's first llm_datadist merge tool writes them
    assert len(assign_ranks(parse_rank_table(t), prefill_tp=1, decode_tp=1)) == 6


def test_router_group_is_optional() -> None:
    t = a2_table()
    del t["server_group_list"][0]
    assert parse_rank_table(t).router is None


# ---------------------------------------------------------------- malformed tables


def mutate(base: dict[str, Any], fn) -> dict[str, Any]:
    t = copy.deepcopy(base)
    fn(t)
    return t


G = "server_group_list"
P0 = f"{G}[1].server_list[0]"


def _dev(t: dict[str, Any], g: int = 1, s: int = 0, d: int = 0) -> dict[str, Any]:
    return t[G][g]["server_list"][s]["device"][d]


MALFORMED = [
    ("not an object", lambda t: t.clear() or t.update({"x": 1}), G, "missing"),
    ("groups not a list", lambda t: t.update({G: {"group_id": "1"}}), G, "expected a list, got dict"),
    ("no groups", lambda t: t.update({G: []}), G, "empty"),
    ("missing group_id", lambda t: t[G][1].pop("group_id"), f"{G}[1].group_id", "missing"),
    ("group_id int", lambda t: t[G][1].update(group_id=1), f"{G}[1].group_id", "expected a non-empty string, got 1"),
    ("unknown group", lambda t: t[G][1].update(group_id="7"), f"{G}[1].group_id", "unknown group '7'"),
    ("duplicate group", lambda t: t[G][2].update(group_id="1"), f"{G}[2].group_id", "duplicate group '1'"),
    ("no decode group", lambda t: t[G].pop(2), G, "no decode group"),
    ("empty prefill", lambda t: t[G][1].update(server_list=[]), f"{G}[1].server_list", "empty"),
    ("server_count wrong", lambda t: t[G][1].update(server_count="3"), f"{G}[1].server_count", "server_list has 2"),
    (
        "two routers",
        lambda t: t[G][0]["server_list"].append({"server_id": "r2", "server_ip": "10.0.0.8"}),
        f"{G}[0].server_list",
        "exactly one server, got 2",
    ),
    ("missing server_id", lambda t: t[G][1]["server_list"][0].pop("server_id"), f"{P0}.server_id", "missing"),
    (
        "bad server ip",
        lambda t: t[G][1]["server_list"][0].update(server_ip="10.0.0.256"),
        f"{P0}.server_ip",
        "not an IPv4 address ('10.0.0.256')",
    ),
    (
        "dup server",
        lambda t: t[G][1]["server_list"][1].update(server_id="10.0.0.1"),
        f"{G}[1].server_list[1].server_id",
        "duplicate server '10.0.0.1'",
    ),
    ("missing devices", lambda t: t[G][1]["server_list"][0].pop("device"), f"{P0}.device", "missing"),
    (
        "device not a list",
        lambda t: t[G][1]["server_list"][0].update(device="0"),
        f"{P0}.device",
        "expected a list, got str",
    ),
    (
        "device entry not object",
        lambda t: t[G][1]["server_list"][0]["device"].append(3),
        f"{P0}.device[2]",
        "expected an object, got int",
    ),
    (
        "bad device ip",
        lambda t: _dev(t, d=1).update(device_ip="192.168.1"),
        f"{P0}.device[1].device_ip",
        "not an IPv4 address ('192.168.1')",
    ),
    ("ipv6 device ip", lambda t: _dev(t).update(device_ip="::1"), f"{P0}.device[0].device_ip", "not an IPv4 address"),
    (
        "device_id float",
        lambda t: _dev(t).update(device_id=1.5),
        f"{P0}.device[0].device_id",
        "expected a non-negative integer (a string of digits), got 1.5",
    ),
    ("device_id bool", lambda t: _dev(t).update(device_id=True), f"{P0}.device[0].device_id", "got True"),
    ("negative rank", lambda t: _dev(t).update(rank_id="-1"), f"{P0}.device[0].rank_id", "got '-1'"),
    ("missing rank_id", lambda t: _dev(t).pop("rank_id"), f"{P0}.device[0].rank_id", "missing"),
    (
        "dup device id",
        lambda t: _dev(t, d=1).update(device_id="1"),
        f"{P0}.device[1].device_id",
        "duplicate device_id 1 in server '10.0.0.1'",
    ),
    (
        "dup rank id",
        lambda t: _dev(t, d=0).update(rank_id="0"),
        f"{P0}.device[1].rank_id",
        "duplicate rank_id 0",
    ),
    (
        "dup device ip",
        lambda t: _dev(t, g=2).update(device_ip="192.168.1.1"),
        f"{G}[2].server_list[0].device[0].device_ip",
        "192.168.1.1 is also used by server_group_list[1].server_list[0].device[1]",
    ),
    (
        "device in P and D",
        lambda t: t[G][2]["server_list"][0].update(server_id="10.0.0.1"),
        f"{G}[2].server_list[0].device[0].device_id",
        "device 0 of '10.0.0.1' is also listed",
    ),
    ("status", lambda t: t.update(status="initializing"), "status", "not completed ('initializing')"),
    ("version", lambda t: t.update(version="2.0"), "version", "expected '1.0' (A2) or '1.2' (A3)"),
    (
        "a2 with super_device_id",
        lambda t: _dev(t).update(super_device_id="1"),
        f"{P0}.device[0].super_device_id",
        "only valid in an A3",
    ),
]


@pytest.mark.parametrize(("case", "fn", "path", "reason"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_tables_name_the_fault(case, fn, path, reason) -> None:
    with pytest.raises(RankTableError) as err:
        parse_rank_table(mutate(a2_table(), fn))
    assert err.value.path == path, str(err.value)
    assert reason in err.value.reason, str(err.value)
    assert str(err.value).startswith(f"{path}: ")


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(RankTableError, match=r"^\$: expected an object, got list"):
        parse_rank_table([])


A3_MALFORMED = [
    (
        "pod references unknown server",
        lambda t: t[G][1]["super_pod_list"][0]["server_list"].append({"server_id": "10.9.9.9"}),
        f"{G}[1].super_pod_list[0].server_list[2].server_id",
        "unknown server '10.9.9.9'",
    ),
    (
        "pod references server of other group",
        lambda t: t[G][2]["super_pod_list"][0]["server_list"].append({"server_id": "10.0.0.1"}),
        f"{G}[2].super_pod_list[0].server_list[1].server_id",
        "unknown server '10.0.0.1'",
    ),
    (
        "server in no pod",
        lambda t: t[G][1]["super_pod_list"][0]["server_list"].pop(),
        f"{G}[1].super_pod_list",
        "servers ['10.0.0.2'] belong to no super pod",
    ),
    (
        "server in two pods",
        lambda t: t[G][1]["super_pod_list"].append({"super_pod_id": "1", "server_list": [{"server_id": "10.0.0.1"}]}),
        f"{G}[1].super_pod_list[1].server_list[0].server_id",
        "already in super pod '0'",
    ),
    ("missing super_device_id", lambda t: _dev(t).pop("super_device_id"), f"{P0}.device[0].super_device_id", "missing"),
    (
        "dup super_device_id in pod",
        lambda t: _dev(t, s=1).update(super_device_id="0"),
        f"{G}[1].super_pod_list[0].server_list[1].server_id",
        "super_device_id 0 of '10.0.0.2' is also used",
    ),
    ("missing super_pod_list", lambda t: t[G][1].pop("super_pod_list"), f"{G}[1].super_pod_list", "missing"),
]


@pytest.mark.parametrize(("case", "fn", "path", "reason"), A3_MALFORMED, ids=[m[0] for m in A3_MALFORMED])
def test_malformed_a3_tables_name_the_fault(case, fn, path, reason) -> None:
    with pytest.raises(RankTableError) as err:
        parse_rank_table(mutate(a3_table(), fn))
    assert err.value.path == path, str(err.value)
    assert reason in err.value.reason, str(err.value)


def test_a3_is_inferred_from_super_fields_without_version() -> None:
    t = a3_table()
    del t["version"]
    assert parse_rank_table(t).is_a3


# ---------------------------------------------------------------- round trip


def test_dump_parse_round_trip() -> None:
    for src in (a2_table(), a3_table()):
        table = parse_rank_table(src)
        assert parse_rank_table(json.loads(json.dumps(dump_rank_table(table)))) == table

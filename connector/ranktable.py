"""The global rank table: which NPU devices serve prefill and decode, and their llm_datadist ids.

A rank table is optional: without one, each worker finds its own device (`pdgate.connector.devices`).
Operators who already have one keep using it. Two shapes are in use, and both are read
(`ranktable_parse.py`, which also says what each check refuses):

* "server_group_list", MindCluster's global-ranktable, which vllm-ascend's first llm_datadist connector
  (PR #684) read. Group "0" is the proxy (router) host, "1" the prefill servers, "2" the decode servers::

    {"version": "1.0" | "1.2", "status": "completed",
     "server_group_list": [
        {"group_id": "0", "server_list": [{"server_ip", "container_ip"?, "server_id"?}]},   # router, optional
        {"group_id": "1", "server_count"?, "server_list": [{"server_id", "server_ip", "container_ip"?,
                            "device": [{"device_id", "device_ip", "rank_id", "super_device_id" (A3)}]}],
         "super_pod_list": [{"super_pod_id", "server_list": [{"server_id"}]}]},           # A3 only
        {"group_id": "2", ...}]}                                                           # decode

  Version "1.2" (Atlas A3) needs `super_device_id` on every device and a `super_pod_list` that puts every
  server of the group in exactly one super pod.

* "device lists", written by vllm-ascend's `examples/disaggregated_prefill_v1/gen_ranktable.py`::

    {"version": "1.2", "server_count": "<hosts>", "status": "completed",
     "prefill_device_list": [{"server_id", "device_id", "device_ip", "cluster_id",
                              "super_pod_id" (A3), "super_device_id" (A3)}, ...],
     "decode_device_list": [...]}

  Its version is "1.2" on A2 hosts too; A3 is told by the super fields. `server_id` is the host's address.

Numbers are strings of digits in both (ints are accepted on input). Derived per device (`assign_ranks`):
within each server, devices sorted by `device_id`; the i-th has `dp_rank = i // tp` and `tp_rank = i % tp`;
`cluster_id` is the table's own when it gives one (device lists), else a running index over prefill
devices, then decode devices. This module holds the typed table, the derivation and the canonical JSON
form (`dump_rank_table`), all pure; `ranktable_cli.py` is the `pdgate-ranktable` command.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pdgate.connector.errors import RankTableError

__all__ = [
    "FORM_DEVICE_LISTS",
    "FORM_GROUPS",
    "GROUP_IDS",
    "GROUP_ROLES",
    "VERSION_A2",
    "VERSION_A3",
    "Device",
    "DevicePlacement",
    "GroupRole",
    "RankTable",
    "Server",
    "ServerGroup",
    "SuperPod",
    "assign_ranks",
    "dump_rank_table",
    "find_placement",
]

VERSION_A2 = "1.0"
VERSION_A3 = "1.2"
FORM_GROUPS = "server_group_list"
FORM_DEVICE_LISTS = "device_lists"


class GroupRole(str, Enum):
    """The job of a rank table's server group (the router's group holds no devices)."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


#: group_id -> role in the server_group_list shape.
GROUP_ROLES: Mapping[str, GroupRole] = {"0": GroupRole.ROUTER, "1": GroupRole.PREFILL, "2": GroupRole.DECODE}
GROUP_IDS: Mapping[GroupRole, str] = {role: gid for gid, role in GROUP_ROLES.items()}
#: role -> key of its list in the device-lists shape.
DEVICE_LISTS: Mapping[GroupRole, str] = {
    GroupRole.PREFILL: "prefill_device_list",
    GroupRole.DECODE: "decode_device_list",
}


@dataclass(frozen=True)
class Device:
    device_id: int
    device_ip: str
    rank_id: int | None  # None only in the device-lists shape, which has no rank ids
    super_device_id: int | None = None
    cluster_id: int | None = None  # the table's own llm_datadist cluster id (device-lists shape)


@dataclass(frozen=True)
class Server:
    server_id: str | None  # None only for the router, which a table may give by address alone
    server_ip: str | None  # None only in the device-lists shape, where server_id is the address
    devices: tuple[Device, ...]
    container_ip: str | None = None


@dataclass(frozen=True)
class SuperPod:
    super_pod_id: str
    server_ids: tuple[str, ...]


@dataclass(frozen=True)
class ServerGroup:
    group_id: str
    servers: tuple[Server, ...]
    super_pods: tuple[SuperPod, ...] = ()

    @property
    def role(self) -> GroupRole:
        return GROUP_ROLES[self.group_id]


@dataclass(frozen=True)
class RankTable:
    groups: tuple[ServerGroup, ...]
    version: str = VERSION_A2  # VERSION_A3 exactly when the table is for Atlas A3 (super pods)
    status: str = "completed"
    form: str = FORM_GROUPS  # the shape it was read from, and is written back in

    @property
    def is_a3(self) -> bool:
        return self.version == VERSION_A3

    def group(self, role: GroupRole) -> ServerGroup | None:
        return next((g for g in self.groups if g.role is role), None)

    @property
    def router(self) -> Server | None:
        group = self.group(GroupRole.ROUTER)
        return group.servers[0] if group else None


@dataclass(frozen=True)
class DevicePlacement:
    """One device's place in the deployment, as the connector and the metaserver need it."""

    role: GroupRole
    server_id: str
    server_ip: str | None
    device_id: int
    device_ip: str
    rank_id: int | None
    dp_rank: int
    tp_rank: int
    cluster_id: int
    super_device_id: int | None
    super_pod_id: str | None


# ------------------------------------------------------------------------------------------
# Derivation
# ------------------------------------------------------------------------------------------


def assign_ranks(table: RankTable, *, prefill_tp: int, decode_tp: int) -> tuple[DevicePlacement, ...]:
    """dp/tp rank and llm_datadist cluster_id for every prefill and decode device.

    Each server is one instance group: its devices, sorted by `device_id`, fill TP groups in order
    (`dp_rank = i // tp`, `tp_rank = i % tp`). A server whose device count is not a multiple of its
    role's TP size is an error: some rank would have no peer.
    """
    out: list[DevicePlacement] = []
    running = 0
    for role, tp in ((GroupRole.PREFILL, prefill_tp), (GroupRole.DECODE, decode_tp)):
        if tp < 1:
            raise RankTableError(f"{role.value}_tp", f"must be >= 1, got {tp}")
        group = table.group(role)
        if group is None:
            raise RankTableError(_where(table, role), f"no {role.value} group")
        pod_of = {sid: pod.super_pod_id for pod in group.super_pods for sid in pod.server_ids}
        for si, server in enumerate(group.servers):
            assert server.server_id is not None  # parsing requires it outside the router group
            if len(server.devices) % tp:
                raise RankTableError(
                    f"{_where(table, role)}.server_list[{si}].device"
                    if table.form == FORM_GROUPS
                    else f"{_where(table, role)} (server {server.server_id!r})",
                    f"{len(server.devices)} devices do not divide into {role.value} tp={tp}",
                )
            for i, dev in enumerate(sorted(server.devices, key=lambda d: d.device_id)):
                out.append(
                    DevicePlacement(
                        role=role,
                        server_id=server.server_id,
                        server_ip=server.server_ip,
                        device_id=dev.device_id,
                        device_ip=dev.device_ip,
                        rank_id=dev.rank_id,
                        dp_rank=i // tp,
                        tp_rank=i % tp,
                        cluster_id=running if dev.cluster_id is None else dev.cluster_id,
                        super_device_id=dev.super_device_id,
                        super_pod_id=pod_of.get(server.server_id),
                    )
                )
                running += 1
    return tuple(out)


def _where(table: RankTable, role: GroupRole) -> str:
    if table.form == FORM_DEVICE_LISTS:
        return DEVICE_LISTS[role]
    group = table.group(role)
    return f"server_group_list[{table.groups.index(group)}]" if group is not None else "server_group_list"


def find_placement(
    placements: Sequence[DevicePlacement], role: GroupRole, server_id: str, dp_rank: int, tp_rank: int
) -> DevicePlacement:
    for p in placements:
        if (p.role, p.server_id, p.dp_rank, p.tp_rank) == (role, server_id, dp_rank, tp_rank):
            return p
    raise RankTableError(
        "server_group_list", f"no {role.value} device on server {server_id!r} with dp_rank {dp_rank}, tp_rank {tp_rank}"
    )


# ------------------------------------------------------------------------------------------
# Canonical JSON
# ------------------------------------------------------------------------------------------


def dump_rank_table(table: RankTable) -> dict[str, Any]:
    """The canonical JSON form, in the shape the table was read from (numbers as strings);
    `parse_rank_table` of it is `table`."""
    if table.form == FORM_DEVICE_LISTS:
        return _dump_device_lists(table)
    groups = []
    for group in table.groups:
        servers = []
        for s in group.servers:
            server: dict[str, Any] = {}
            if s.server_id is not None:
                server["server_id"] = s.server_id
            server["server_ip"] = s.server_ip
            if s.container_ip is not None:
                server["container_ip"] = s.container_ip
            if s.devices or group.role is not GroupRole.ROUTER:
                server["device"] = [_dump_device(d) for d in s.devices]
            servers.append(server)
        out: dict[str, Any] = {"group_id": group.group_id, "server_count": str(len(servers)), "server_list": servers}
        if group.super_pods:
            out["super_pod_list"] = [
                {"super_pod_id": p.super_pod_id, "server_list": [{"server_id": sid} for sid in p.server_ids]}
                for p in group.super_pods
            ]
        groups.append(out)
    return {"version": table.version, "status": table.status, "server_group_list": groups}


def _dump_device(d: Device) -> dict[str, str]:
    out = {"device_id": str(d.device_id), "device_ip": d.device_ip}
    if d.rank_id is not None:
        out["rank_id"] = str(d.rank_id)
    if d.super_device_id is not None:
        out["super_device_id"] = str(d.super_device_id)
    return out


def _dump_device_lists(table: RankTable) -> dict[str, Any]:
    out: dict[str, Any] = {"version": VERSION_A3, "server_count": "0", "status": table.status}
    hosts: set[str] = set()
    for role, key in DEVICE_LISTS.items():
        group = table.group(role)
        pod_of = {sid: p.super_pod_id for p in group.super_pods for sid in p.server_ids} if group else {}
        entries = []
        for server in group.servers if group else ():
            assert server.server_id is not None
            hosts.add(server.server_id)
            for d in server.devices:
                entry = {"server_id": server.server_id, "device_id": str(d.device_id), "device_ip": d.device_ip}
                if d.super_device_id is not None:
                    entry["super_pod_id"] = pod_of[server.server_id]
                    entry["super_device_id"] = str(d.super_device_id)
                entry["cluster_id"] = str(d.cluster_id)
                entries.append(entry)
        out[key] = entries
    out["server_count"] = str(len(hosts))
    return out

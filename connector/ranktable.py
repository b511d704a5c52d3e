"""The global rank table: which NPU devices serve prefill and decode, and their llm_datadist ids.

Format (PR #684's ``LLMDATADIST_GLOBAL_RANKTABLE``, after MindCluster's global-ranktable;
reference ``vllm-connector-api.md`` 4.4 and 4.7)::

    {"version": "1.0" | "1.2", "status": "completed",
     "server_group_list": [
        {"group_id": "0", "server_list": [{"server_id", "server_ip"}]},          # router, 1 server
        {"group_id": "1", "server_list": [{"server_id", "server_ip",             # prefill
                                           "device": [{"device_id", "device_ip", "rank_id",
                                                       "super_device_id" (A3)}]}],
         "super_pod_list": [{"super_pod_id", "server_list": [{"server_id"}]}]},  # A3 only
        {"group_id": "2", ...}]}                                                  # decode

Numbers are written as strings of digits (as the seed files do); ints are accepted on input.
A3 (version "1.2") needs ``super_device_id`` on every device and a ``super_pod_list`` that
puts every server of the group in exactly one super pod.

Derived per device (4.7): within each server, devices sorted by ``device_id``; the i-th has
``dp_rank = i // tp`` and ``tp_rank = i % tp``; ``cluster_id`` is a running index over prefill
devices, then decode devices. Every check names the fault by path, e.g.
``server_group_list[1].server_list[0].device[2].device_ip: not an IPv4 address ('10.0.0')``.

Everything here is pure: data in, data out (``load_rank_table`` reads one file). Building a table
from host lists (``generate``) and the ``pdgate-ranktable`` command line are in ``ranktable_cli.py``.
A rank table is optional: without one, each worker finds its own device (``pdgate.connector.devices``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "Device",
    "DevicePlacement",
    "RankTable",
    "RankTableError",
    "Role",
    "Server",
    "ServerGroup",
    "SuperPod",
    "assign_ranks",
    "dump_rank_table",
    "find_placement",
    "load_rank_table",
    "main",
    "parse_rank_table",
]

VERSION_A2 = "1.0"
VERSION_A3 = "1.2"


class Role(str, Enum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


#: group_id -> role, as PR #684 fixed them.
GROUP_ROLES: Mapping[str, Role] = {"0": Role.ROUTER, "1": Role.PREFILL, "2": Role.DECODE}
GROUP_IDS: Mapping[Role, str] = {role: gid for gid, role in GROUP_ROLES.items()}


class RankTableError(ValueError):
    """A malformed rank table. ``path`` locates the fault, ``reason`` says what is wrong."""

    code = "ranktable_invalid"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


# ------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    device_id: int
    device_ip: str
    rank_id: int
    super_device_id: int | None = None


@dataclass(frozen=True)
class Server:
    server_id: str
    server_ip: str
    devices: tuple[Device, ...]


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
    def role(self) -> Role:
        return GROUP_ROLES[self.group_id]


@dataclass(frozen=True)
class RankTable:
    groups: tuple[ServerGroup, ...]
    version: str = VERSION_A2
    status: str = "completed"

    @property
    def is_a3(self) -> bool:
        return self.version == VERSION_A3

    def group(self, role: Role) -> ServerGroup | None:
        return next((g for g in self.groups if g.role is role), None)

    @property
    def router(self) -> Server | None:
        group = self.group(Role.ROUTER)
        return group.servers[0] if group else None


@dataclass(frozen=True)
class DevicePlacement:
    """One device's place in the deployment, as the connector and the metaserver need it."""

    role: Role
    server_id: str
    server_ip: str
    device_id: int
    device_ip: str
    rank_id: int
    dp_rank: int
    tp_rank: int
    cluster_id: int
    super_device_id: int | None
    super_pod_id: str | None


# ------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RankTableError(path, f"expected an object, got {_type_name(value)}")
    return value


def _list(parent: Mapping[str, Any], key: str, path: str, *, required: bool = True) -> list[Any]:
    if key not in parent:
        if required:
            raise RankTableError(f"{path}.{key}" if path else key, "missing")
        return []
    value = parent[key]
    where = f"{path}.{key}" if path else key
    if not isinstance(value, list):
        raise RankTableError(where, f"expected a list, got {_type_name(value)}")
    if required and not value:
        raise RankTableError(where, "empty")
    return value


def _str(parent: Mapping[str, Any], key: str, path: str) -> str:
    where = f"{path}.{key}"
    if key not in parent:
        raise RankTableError(where, "missing")
    value = parent[key]
    if not isinstance(value, str) or not value.strip():
        raise RankTableError(where, f"expected a non-empty string, got {value!r}")
    return value


def _uint(parent: Mapping[str, Any], key: str, path: str) -> int:
    where = f"{path}.{key}"
    if key not in parent:
        raise RankTableError(where, "missing")
    value = parent[key]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return int(value)
    raise RankTableError(where, f"expected a non-negative integer (a string of digits), got {value!r}")


def _ipv4(parent: Mapping[str, Any], key: str, path: str) -> str:
    value = _str(parent, key, path)
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise RankTableError(f"{path}.{key}", f"not an IPv4 address ({value!r})") from None


def parse_rank_table(data: object) -> RankTable:
    """Validate a decoded rank table and return its typed form; RankTableError names the fault."""
    top = _obj(data, "$")
    version = top.get("version", None)
    if version is not None and version not in (VERSION_A2, VERSION_A3):
        raise RankTableError("version", f"expected {VERSION_A2!r} (A2) or {VERSION_A3!r} (A3), got {version!r}")
    status = top.get("status", "completed")
    if status != "completed":
        raise RankTableError("status", f"rank table is not completed ({status!r})")
    raw_groups = _list(top, "server_group_list", "")
    a3 = version == VERSION_A3 or (version is None and _mentions_a3(raw_groups))
    groups: list[ServerGroup] = []
    seen_groups: dict[str, str] = {}
    for gi, raw in enumerate(raw_groups):
        path = f"server_group_list[{gi}]"
        group = _parse_group(_obj(raw, path), path, a3=a3)
        if group.group_id in seen_groups:
            raise RankTableError(
                f"{path}.group_id", f"duplicate group {group.group_id!r} (also {seen_groups[group.group_id]})"
            )
        seen_groups[group.group_id] = path
        groups.append(group)
    for role in (Role.PREFILL, Role.DECODE):
        if GROUP_IDS[role] not in seen_groups:
            raise RankTableError("server_group_list", f"no {role.value} group (group_id {GROUP_IDS[role]!r})")
    table = RankTable(tuple(groups), VERSION_A3 if a3 else VERSION_A2, "completed")
    _check_global_uniqueness(table)
    return table


def _mentions_a3(raw_groups: list[Any]) -> bool:
    for g in raw_groups:
        if isinstance(g, Mapping) and "super_pod_list" in g:
            return True
        for s in g.get("server_list", []) if isinstance(g, Mapping) else []:
            for d in s.get("device", []) if isinstance(s, Mapping) else []:
                if isinstance(d, Mapping) and "super_device_id" in d:
                    return True
    return False


def _parse_group(raw: Mapping[str, Any], path: str, *, a3: bool) -> ServerGroup:
    gid = _str(raw, "group_id", path)
    if gid not in GROUP_ROLES:
        raise RankTableError(
            f"{path}.group_id", f"unknown group {gid!r} (expected '0' router, '1' prefill, '2' decode)"
        )
    role = GROUP_ROLES[gid]
    raw_servers = _list(raw, "server_list", path)
    if "server_count" in raw and _uint(raw, "server_count", path) != len(raw_servers):
        raise RankTableError(
            f"{path}.server_count", f"says {raw['server_count']} but server_list has {len(raw_servers)}"
        )
    if role is Role.ROUTER and len(raw_servers) != 1:
        raise RankTableError(
            f"{path}.server_list", f"the router group needs exactly one server, got {len(raw_servers)}"
        )
    servers: list[Server] = []
    ids: set[str] = set()
    ranks: dict[int, str] = {}
    for si, raw_server in enumerate(raw_servers):
        spath = f"{path}.server_list[{si}]"
        server = _parse_server(_obj(raw_server, spath), spath, role=role, a3=a3)
        if server.server_id in ids:
            raise RankTableError(f"{spath}.server_id", f"duplicate server {server.server_id!r} in this group")
        ids.add(server.server_id)
        for di, dev in enumerate(server.devices):
            if dev.rank_id in ranks:
                raise RankTableError(
                    f"{spath}.device[{di}].rank_id", f"duplicate rank_id {dev.rank_id} (also {ranks[dev.rank_id]})"
                )
            ranks[dev.rank_id] = f"{spath}.device[{di}]"
        servers.append(server)
    pods: tuple[SuperPod, ...] = ()
    if role is not Role.ROUTER and a3:
        pods = _parse_super_pods(raw, path, servers)
    elif "super_pod_list" in raw and not a3:
        raise RankTableError(f"{path}.super_pod_list", "only valid in an A3 (version 1.2) rank table")
    return ServerGroup(gid, tuple(servers), pods)


def _parse_server(raw: Mapping[str, Any], path: str, *, role: Role, a3: bool) -> Server:
    server_id = _str(raw, "server_id", path)
    server_ip = _ipv4(raw, "server_ip", path)
    raw_devices = _list(raw, "device", path, required=role is not Role.ROUTER)
    devices: list[Device] = []
    ids: set[int] = set()
    for di, raw_dev in enumerate(raw_devices):
        dpath = f"{path}.device[{di}]"
        dev_raw = _obj(raw_dev, dpath)
        device_id = _uint(dev_raw, "device_id", dpath)
        if device_id in ids:
            raise RankTableError(f"{dpath}.device_id", f"duplicate device_id {device_id} in server {server_id!r}")
        ids.add(device_id)
        sdid = None
        if a3:
            sdid = _uint(dev_raw, "super_device_id", dpath)
        elif "super_device_id" in dev_raw:
            raise RankTableError(f"{dpath}.super_device_id", "only valid in an A3 (version 1.2) rank table")
        devices.append(Device(device_id, _ipv4(dev_raw, "device_ip", dpath), _uint(dev_raw, "rank_id", dpath), sdid))
    return Server(server_id, server_ip, tuple(devices))


def _parse_super_pods(raw: Mapping[str, Any], path: str, servers: list[Server]) -> tuple[SuperPod, ...]:
    raw_pods = _list(raw, "super_pod_list", path)
    known = {s.server_id: s for s in servers}
    placed: dict[str, str] = {}
    pods: list[SuperPod] = []
    for pi, raw_pod in enumerate(raw_pods):
        ppath = f"{path}.super_pod_list[{pi}]"
        pod_raw = _obj(raw_pod, ppath)
        pod_id = _str(pod_raw, "super_pod_id", ppath)
        members: list[str] = []
        sdids: dict[int, str] = {}
        for mi, raw_member in enumerate(_list(pod_raw, "server_list", ppath)):
            mpath = f"{ppath}.server_list[{mi}]"
            sid = _str(_obj(raw_member, mpath), "server_id", mpath)
            if sid not in known:
                raise RankTableError(f"{mpath}.server_id", f"unknown server {sid!r} (not in this group's server_list)")
            if sid in placed:
                raise RankTableError(f"{mpath}.server_id", f"server {sid!r} is already in {placed[sid]}")
            placed[sid] = f"super pod {pod_id!r}"
            for dev in known[sid].devices:
                sdid = dev.super_device_id
                assert sdid is not None  # A3 parsing made it mandatory
                if sdid in sdids:
                    raise RankTableError(
                        f"{mpath}.server_id", f"super_device_id {sdid} of {sid!r} is also used by {sdids[sdid]}"
                    )
                sdids[sdid] = f"{sid!r} device {dev.device_id}"
            members.append(sid)
        pods.append(SuperPod(pod_id, tuple(members)))
    missing = [sid for sid in known if sid not in placed]
    if missing:
        raise RankTableError(f"{path}.super_pod_list", f"servers {missing} belong to no super pod")
    return tuple(pods)


def _check_global_uniqueness(table: RankTable) -> None:
    ips: dict[str, str] = {}
    devices: dict[tuple[str, int], str] = {}
    for gi, group in enumerate(table.groups):
        for si, server in enumerate(group.servers):
            for di, dev in enumerate(server.devices):
                path = f"server_group_list[{gi}].server_list[{si}].device[{di}]"
                if dev.device_ip in ips:
                    raise RankTableError(f"{path}.device_ip", f"{dev.device_ip} is also used by {ips[dev.device_ip]}")
                ips[dev.device_ip] = path
                key = (server.server_id, dev.device_id)
                if key in devices:
                    raise RankTableError(
                        f"{path}.device_id",
                        f"device {dev.device_id} of {server.server_id!r} is also listed at {devices[key]}",
                    )
                devices[key] = path


def load_rank_table(path: str | Path) -> RankTable:
    """Read and validate a rank table file; unreadable or non-JSON files are RankTableErrors too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RankTableError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RankTableError(str(path), f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return parse_rank_table(data)


def dump_rank_table(table: RankTable) -> dict[str, Any]:
    """The canonical JSON form (numbers as strings); ``parse_rank_table`` of it is ``table``."""
    groups = []
    for group in table.groups:
        servers = []
        for s in group.servers:
            server: dict[str, Any] = {"server_id": s.server_id, "server_ip": s.server_ip}
            if s.devices or group.role is not Role.ROUTER:
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
    out = {"device_id": str(d.device_id), "device_ip": d.device_ip, "rank_id": str(d.rank_id)}
    if d.super_device_id is not None:
        out["super_device_id"] = str(d.super_device_id)
    return out


# ------------------------------------------------------------------------------------------
# Derivation
# ------------------------------------------------------------------------------------------


def assign_ranks(table: RankTable, *, prefill_tp: int, decode_tp: int) -> tuple[DevicePlacement, ...]:
    """dp/tp rank and llm_datadist cluster_id for every prefill and decode device (4.7).

    Each server is one instance group: its devices, sorted by ``device_id``, fill TP groups
    in order (``dp_rank = i // tp``, ``tp_rank = i % tp``). A server whose device count is not
    a multiple of its role's TP size is an error: some rank would have no peer.
    """
    out: list[DevicePlacement] = []
    cluster_id = 0
    for role, tp in ((Role.PREFILL, prefill_tp), (Role.DECODE, decode_tp)):
        if tp < 1:
            raise RankTableError(f"{role.value}_tp", f"must be >= 1, got {tp}")
        group = table.group(role)
        if group is None:
            raise RankTableError("server_group_list", f"no {role.value} group")
        gi = table.groups.index(group)
        pod_of = {sid: pod.super_pod_id for pod in group.super_pods for sid in pod.server_ids}
        for si, server in enumerate(group.servers):
            if len(server.devices) % tp:
                raise RankTableError(
                    f"server_group_list[{gi}].server_list[{si}].device",
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
                        cluster_id=cluster_id,
                        super_device_id=dev.super_device_id,
                        super_pod_id=pod_of.get(server.server_id),
                    )
                )
                cluster_id += 1
    return tuple(out)


def find_placement(
    placements: Sequence[DevicePlacement], role: Role, server_id: str, dp_rank: int, tp_rank: int
) -> DevicePlacement:
    for p in placements:
        if (p.role, p.server_id, p.dp_rank, p.tp_rank) == (role, server_id, dp_rank, tp_rank):
            return p
    raise RankTableError(
        "server_group_list", f"no {role.value} device on server {server_id!r} with dp_rank {dp_rank}, tp_rank {tp_rank}"
    )


# ------------------------------------------------------------------------------------------
# The CLI lives in ranktable_cli.py; these keep `pdgate.connector.ranktable:main` (the pdgate-ranktable
# console script), `python -m pdgate.connector.ranktable` and older imports of the generator working.
# ------------------------------------------------------------------------------------------

_CLI_NAMES = ("HostSpec", "generate", "parse_host_spec")


def main(argv: Sequence[str] | None = None) -> int:
    """``pdgate-ranktable``; see ``pdgate.connector.ranktable_cli``."""
    from pdgate.connector.ranktable_cli import main as cli_main

    return cli_main(argv)


def __getattr__(name: str) -> Any:
    if name in _CLI_NAMES:
        import pdgate.connector.ranktable_cli as cli

        return getattr(cli, name)
    raise AttributeError(f"module 'pdgate.connector.ranktable' has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())

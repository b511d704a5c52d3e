"""Read and check a global rank table, in either shape `ranktable.py` describes; every fault named by path.

`parse_rank_table` takes the decoded JSON and returns the typed `RankTable`, or raises `RankTableError`
with the path of the first fault and what is wrong, e.g.
`server_group_list[1].server_list[0].device[2].device_ip: not an IPv4 address ('10.0.0')`. What it checks,
in both shapes: every number is a non-negative integer (a string of digits, or an int); every IP an IPv4
address; a device IP and a (server, device id) pair appear once in the whole table; the prefill and the
decode side are both present; status is "completed". In the server_group_list shape also: group ids are
"0", "1" or "2", each once; the router group, when present, has exactly one server, which needs only
`server_ip` (the proxy host of vllm-ascend's first llm_datadist connector gives `server_ip` and
`container_ip` and nothing else); prefill and decode servers have `server_id`, `server_ip` and devices,
with `rank_id` unique in their server; A3 super pods cover every server once. In the device-lists shape
also: `cluster_id` unique; on A3 every device has `super_pod_id` and `super_device_id`, and a server's
devices agree on their super pod. Keys neither shape uses (`deploy_server`, `device_logical_id`) are
ignored. `load_rank_table` reads one file; nothing else here does I/O.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdgate.connector.errors import RankTableError
from pdgate.connector.ranktable import (
    DEVICE_LISTS,
    FORM_DEVICE_LISTS,
    GROUP_IDS,
    GROUP_ROLES,
    VERSION_A2,
    VERSION_A3,
    Device,
    GroupRole,
    RankTable,
    Server,
    ServerGroup,
    SuperPod,
)

__all__ = ["load_rank_table", "parse_rank_table"]


def load_rank_table(path: str | Path) -> RankTable:
    """Read and check a rank table file; unreadable or non-JSON files are RankTableErrors too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RankTableError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RankTableError(str(path), f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return parse_rank_table(data)


def parse_rank_table(data: object) -> RankTable:
    """Check a decoded rank table and return its typed form; RankTableError names the fault."""
    top = _obj(data, "$")
    status = top.get("status", "completed")
    if status != "completed":
        raise RankTableError("status", f"rank table is not completed ({status!r})")
    if "server_group_list" not in top and any(key in top for key in DEVICE_LISTS.values()):
        table = _parse_device_lists(top)
    else:
        table = _parse_groups(top)
    _check_global_uniqueness(table)
    return table


# ---- scalar fields ------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RankTableError(path, f"expected an object, got {_type_name(value)}")
    return value


def _list(parent: Mapping[str, Any], key: str, path: str, *, required: bool = True) -> list[Any]:
    where = f"{path}.{key}" if path else key
    if key not in parent:
        if required:
            raise RankTableError(where, "missing")
        return []
    value = parent[key]
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


def _optional(parent: Mapping[str, Any], key: str, path: str, read: Any) -> Any:
    return read(parent, key, path) if key in parent else None


# ---- the server_group_list shape ----------------------------------------------------------------


def _parse_groups(top: Mapping[str, Any]) -> RankTable:
    version = top.get("version", None)
    if version is not None and version not in (VERSION_A2, VERSION_A3):
        raise RankTableError("version", f"expected {VERSION_A2!r} (A2) or {VERSION_A3!r} (A3), got {version!r}")
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
    for role in (GroupRole.PREFILL, GroupRole.DECODE):
        if GROUP_IDS[role] not in seen_groups:
            raise RankTableError("server_group_list", f"no {role.value} group (group_id {GROUP_IDS[role]!r})")
    return RankTable(tuple(groups), VERSION_A3 if a3 else VERSION_A2, "completed")


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
    if role is GroupRole.ROUTER and len(raw_servers) != 1:
        raise RankTableError(
            f"{path}.server_list", f"the router group needs exactly one server, got {len(raw_servers)}"
        )
    servers: list[Server] = []
    ids: set[str] = set()
    for si, raw_server in enumerate(raw_servers):
        spath = f"{path}.server_list[{si}]"
        server = _parse_server(_obj(raw_server, spath), spath, role=role, a3=a3)
        if server.server_id is not None:
            if server.server_id in ids:
                raise RankTableError(f"{spath}.server_id", f"duplicate server {server.server_id!r} in this group")
            ids.add(server.server_id)
        # rank_id is unique per server: the merge tool of vllm-ascend's first llm_datadist connector
        # numbers each server's devices from 0 (MindCluster numbers them across the group, which passes too).
        ranks: dict[int, str] = {}
        for di, dev in enumerate(server.devices):
            assert dev.rank_id is not None  # required in this shape
            if dev.rank_id in ranks:
                raise RankTableError(
                    f"{spath}.device[{di}].rank_id", f"duplicate rank_id {dev.rank_id} (also {ranks[dev.rank_id]})"
                )
            ranks[dev.rank_id] = f"{spath}.device[{di}]"
        servers.append(server)
    pods: tuple[SuperPod, ...] = ()
    if role is not GroupRole.ROUTER and a3:
        pods = _parse_super_pods(raw, path, servers)
    elif "super_pod_list" in raw and not a3:
        raise RankTableError(f"{path}.super_pod_list", "only valid in an A3 (version 1.2) rank table")
    return ServerGroup(gid, tuple(servers), pods)


def _parse_server(raw: Mapping[str, Any], path: str, *, role: GroupRole, a3: bool) -> Server:
    router = role is GroupRole.ROUTER
    # The proxy host is named by its address alone in vllm-ascend's first llm_datadist tables.
    server_id = _optional(raw, "server_id", path, _str) if router else _str(raw, "server_id", path)
    server_ip = _ipv4(raw, "server_ip", path)
    container_ip = _optional(raw, "container_ip", path, _ipv4)
    raw_devices = _list(raw, "device", path, required=not router)
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
    return Server(server_id, server_ip, tuple(devices), container_ip)


def _parse_super_pods(raw: Mapping[str, Any], path: str, servers: list[Server]) -> tuple[SuperPod, ...]:
    raw_pods = _list(raw, "super_pod_list", path)
    known = {s.server_id: s for s in servers if s.server_id is not None}
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
            _check_super_devices(known[sid], sdids, f"{mpath}.server_id")
            members.append(sid)
        pods.append(SuperPod(pod_id, tuple(members)))
    missing = [sid for sid in known if sid not in placed]
    if missing:
        raise RankTableError(f"{path}.super_pod_list", f"servers {missing} belong to no super pod")
    return tuple(pods)


def _check_super_devices(server: Server, seen: dict[int, str], where: str) -> None:
    """Within one super pod, every super_device_id is used once."""
    for dev in server.devices:
        sdid = dev.super_device_id
        assert sdid is not None  # A3 parsing made it mandatory
        if sdid in seen:
            raise RankTableError(where, f"super_device_id {sdid} of {server.server_id!r} is also used by {seen[sdid]}")
        seen[sdid] = f"{server.server_id!r} device {dev.device_id}"


# ---- the device-lists shape (vllm-ascend's gen_ranktable.py) ------------------------------------


def _parse_device_lists(top: Mapping[str, Any]) -> RankTable:
    if "server_count" in top:
        _uint(top, "server_count", "$")
    lists = [top.get(key) for key in DEVICE_LISTS.values()]
    a3 = any(
        isinstance(d, Mapping) and ("super_device_id" in d or "super_pod_id" in d)
        for devices in lists
        if isinstance(devices, list)
        for d in devices
    )
    groups: list[ServerGroup] = []
    clusters: dict[int, str] = {}
    for role, key in DEVICE_LISTS.items():
        servers: dict[str, list[Device]] = {}
        pod_of: dict[str, tuple[str, str]] = {}  # server_id -> (super_pod_id, where it was first given)
        for di, raw_dev in enumerate(_list(top, key, "")):
            dpath = f"{key}[{di}]"
            dev_raw = _obj(raw_dev, dpath)
            server_id = _str(dev_raw, "server_id", dpath)
            device_id = _uint(dev_raw, "device_id", dpath)
            cluster_id = _uint(dev_raw, "cluster_id", dpath)
            if cluster_id in clusters:
                raise RankTableError(
                    f"{dpath}.cluster_id", f"duplicate cluster_id {cluster_id} (also {clusters[cluster_id]})"
                )
            clusters[cluster_id] = dpath
            sdid = None
            if a3:
                sdid = _uint(dev_raw, "super_device_id", dpath)
                pod = _str(dev_raw, "super_pod_id", dpath)
                first = pod_of.setdefault(server_id, (pod, dpath))
                if first[0] != pod:
                    raise RankTableError(
                        f"{dpath}.super_pod_id", f"server {server_id!r} is in super pod {first[0]!r} at {first[1]}"
                    )
            devices = servers.setdefault(server_id, [])
            if any(d.device_id == device_id for d in devices):
                raise RankTableError(f"{dpath}.device_id", f"duplicate device_id {device_id} in server {server_id!r}")
            devices.append(Device(device_id, _ipv4(dev_raw, "device_ip", dpath), None, sdid, cluster_id))
        group_servers = tuple(Server(sid, _address(sid), tuple(devs)) for sid, devs in servers.items())
        pods: tuple[SuperPod, ...] = ()
        if a3:
            members: dict[str, list[str]] = {}
            for sid, (pod, _) in pod_of.items():
                members.setdefault(pod, []).append(sid)
            pods = tuple(SuperPod(pod, tuple(sids)) for pod, sids in members.items())
            for pod_servers in members.values():
                seen: dict[int, str] = {}
                for server in group_servers:
                    if server.server_id in pod_servers:
                        _check_super_devices(server, seen, key)
        groups.append(ServerGroup(GROUP_IDS[role], group_servers, pods))
    return RankTable(tuple(groups), VERSION_A3 if a3 else VERSION_A2, "completed", FORM_DEVICE_LISTS)


def _address(server_id: str) -> str | None:
    """gen_ranktable.py writes the host's address as its server_id."""
    try:
        return str(ipaddress.IPv4Address(server_id))
    except ValueError:
        return None


# ---- both shapes ----------------------------------------------------------------------------------


def _check_global_uniqueness(table: RankTable) -> None:
    ips: dict[str, str] = {}
    devices: dict[tuple[str | None, int], str] = {}
    for gi, group in enumerate(table.groups):
        for si, server in enumerate(group.servers):
            for di, dev in enumerate(server.devices):
                if table.form == FORM_DEVICE_LISTS:
                    path = f"{DEVICE_LISTS[group.role]} (server {server.server_id!r} device {dev.device_id})"
                else:
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

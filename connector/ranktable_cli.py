"""`pdgate-ranktable`: validate a global rank table, or generate one from host/device lists.

`validate` reads either shape `pdgate.connector.ranktable` describes (MindCluster's server_group_list, as
vllm-ascend's first llm_datadist connector used it, or the device lists of vllm-ascend's gen_ranktable.py)
and prints what each device becomes (`--show`). `generate` builds a server_group_list table from
`HOST:[ID=]DEVICE_IP[/SUPER_DEVICE_ID],...` specs and checks it exactly as a file is checked
(`pdgate.connector.ranktable_parse.parse_rank_table`), so a generated table is never one the connector
would refuse. Exit codes: 0 valid/written, 1 invalid rank table, 2 bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdgate.connector.errors import RankTableError
from pdgate.connector.ranktable import VERSION_A2, VERSION_A3, GroupRole, RankTable, assign_ranks, dump_rank_table
from pdgate.connector.ranktable_parse import load_rank_table, parse_rank_table

__all__ = ["HostSpec", "generate", "main", "parse_host_spec"]


# ------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostSpec:
    """One server for ``generate``: its IP (also its server_id) and its devices in order."""

    server_ip: str
    devices: tuple[tuple[int, str, int | None], ...]  # (device_id, device_ip, super_device_id)


def parse_host_spec(text: str) -> HostSpec:
    """``HOST:[ID=]DEVICE_IP[/SUPER_DEVICE_ID],...``; device ids default to 0, 1, ... in order."""
    host, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"{text!r}: expected HOST:DEVICE_IP[,DEVICE_IP...]")
    devices = []
    for i, item in enumerate(rest.split(",")):
        dev_id_text, eq, ip_part = item.partition("=")
        if not eq:
            dev_id_text, ip_part = str(i), item
        ip_text, slash, sdid_text = ip_part.partition("/")
        if not dev_id_text.isdigit() or (slash and not sdid_text.isdigit()):
            raise ValueError(f"{text!r}: bad device entry {item!r}; expected [ID=]IP[/SUPER_DEVICE_ID]")
        devices.append((int(dev_id_text), ip_text, int(sdid_text) if slash else None))
    return HostSpec(host, tuple(devices))


def generate(
    prefill: Sequence[HostSpec],
    decode: Sequence[HostSpec],
    *,
    router: str | None = None,
    a3: bool = False,
    super_pods: Mapping[str, Sequence[str]] | None = None,
) -> RankTable:
    """Build a rank table from host/device lists and validate it the same way a file is.

    ``super_pods`` maps super_pod_id -> host IPs (A3 only); without it every server of a
    group goes into super pod ``"0"``. rank_ids run from 0 within each group.
    """
    hosts_known = {h.server_ip for h in (*prefill, *decode)}
    for pid, members in (super_pods or {}).items():
        for h in members:
            if h not in hosts_known:
                raise RankTableError(f"super pod {pid!r}", f"unknown host {h!r} (not a --prefill or --decode server)")
    doc: dict[str, Any] = {"version": VERSION_A3 if a3 else VERSION_A2, "status": "completed", "server_group_list": []}
    if router is not None:
        doc["server_group_list"].append({"group_id": "0", "server_list": [{"server_id": router, "server_ip": router}]})
    for gid, hosts in (("1", prefill), ("2", decode)):
        servers, rank = [], 0
        for host in hosts:
            devs = []
            for dev_id, ip, sdid in host.devices:
                dev = {"device_id": str(dev_id), "device_ip": ip, "rank_id": str(rank)}
                if sdid is not None:
                    dev["super_device_id"] = str(sdid)
                devs.append(dev)
                rank += 1
            servers.append({"server_id": host.server_ip, "server_ip": host.server_ip, "device": devs})
        group: dict[str, Any] = {"group_id": gid, "server_count": str(len(servers)), "server_list": servers}
        if a3:
            names = [h.server_ip for h in hosts]
            pods = super_pods or {"0": names}
            group["super_pod_list"] = [
                {"super_pod_id": pid, "server_list": [{"server_id": h} for h in members if h in names]}
                for pid, members in pods.items()
                if any(h in names for h in members)
            ]
        doc["server_group_list"].append(group)
    return parse_rank_table(doc)


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pdgate-ranktable",
        description="Validate or generate the global rank table that maps prefill/decode NPU devices "
        "to llm_datadist clusters (server_group_list: group 0 router, 1 prefill, 2 decode; or "
        "gen_ranktable.py's prefill_device_list/decode_device_list).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a rank table file; exit 0 if valid, 1 with the fault if not")
    v.add_argument("file", help="rank table JSON file")
    v.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size used to derive ranks (default 1)")
    v.add_argument("--decode-tp", type=int, default=1, help="decode TP size used to derive ranks (default 1)")
    v.add_argument("--show", action="store_true", help="print every device's role, dp/tp rank and cluster_id")
    g = sub.add_parser(
        "generate",
        help="write a rank table from host/device lists",
        description="Each --prefill/--decode names one server: HOST:[ID=]DEVICE_IP[/SUPER_DEVICE_ID],... "
        "e.g. --prefill 10.0.0.1:192.168.1.1,192.168.1.2 (device ids default to 0,1,... in order). "
        "HOST is the server's IPv4 address and also its server_id.",
    )
    g.add_argument(
        "--prefill", action="append", required=True, metavar="HOST:DEVICES", help="a prefill server (repeat)"
    )
    g.add_argument("--decode", action="append", required=True, metavar="HOST:DEVICES", help="a decode server (repeat)")
    g.add_argument("--router", metavar="HOST", help="the router's IPv4 address (group 0); optional")
    g.add_argument("--a3", action="store_true", help="Atlas A3: version 1.2, super_device_id on every device")
    g.add_argument(
        "--super-pod",
        action="append",
        default=[],
        metavar="ID=HOST,...",
        help="A3 super pod membership (repeat); default: every server in super pod 0",
    )
    g.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``pdgate-ranktable``: 0 valid/written, 1 invalid rank table, 2 bad command line."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "validate":
            return _cmd_validate(args)
        return _cmd_generate(args, parser)
    except RankTableError as exc:
        print(f"pdgate-ranktable: invalid rank table: {exc}", file=sys.stderr)
        return 1


def _cmd_validate(args: argparse.Namespace) -> int:
    table = load_rank_table(args.file)
    placements = assign_ranks(table, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
    counts = {role: sum(1 for p in placements if p.role is role) for role in (GroupRole.PREFILL, GroupRole.DECODE)}
    router = table.router
    print(
        f"OK {args.file}: {'A3' if table.is_a3 else 'A2'}, router {router.server_ip if router else 'none'}, "
        f"{counts[GroupRole.PREFILL]} prefill and {counts[GroupRole.DECODE]} decode devices"
    )
    if args.show:
        for p in placements:
            print(
                f"{p.role.value:8} server {p.server_id:15} device {p.device_id:2} {p.device_ip:15} "
                f"dp {p.dp_rank} tp {p.tp_rank} cluster_id {p.cluster_id}"
            )
    return 0


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        prefill = [parse_host_spec(s) for s in args.prefill]
        decode = [parse_host_spec(s) for s in args.decode]
        pods: dict[str, list[str]] = {}
        for item in args.super_pod:
            pid, eq, hosts = item.partition("=")
            if not eq or not pid or not hosts:
                raise ValueError(f"--super-pod {item!r}: expected ID=HOST[,HOST...]")
            pods[pid] = hosts.split(",")
    except ValueError as exc:
        parser.error(str(exc))
    if pods and not args.a3:
        parser.error("--super-pod needs --a3")
    table = generate(prefill, decode, router=args.router, a3=args.a3, super_pods=pods or None)
    text = json.dumps(dump_rank_table(table), indent=2) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

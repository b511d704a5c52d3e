"""Scenario 7: network partitions, on the network-namespace hosts of the deploy rehearsal (tests/deploy/netns.py).

Hosts: `head` (metaserver, router), `eng1` (prefill p0, decode d0), `eng2` (prefill p1, decode d1), joined
by the rehearsal's bridge. This file adds one veth from the root namespace onto that bridge, so that Redis,
the load and the orchestrator (all in the root namespace) reach the hosts the way clients outside the
cluster would; deleting the namespaces at the end removes that veth with them.

Cuts (each `partition_s` long, then healed):
  1. head <-> eng1: eng1's bridge port goes down; eng1 can reach nobody and nobody reaches it.
  2. decode d1 (eng2) <-> prefill p0 (eng1): iptables DROP between the two addresses inside eng2 (full mode).
     pdgate-sim moves no KV bytes between engines (the ledger carries the handoff), so this cut shows what
     the control plane does when the pair is cut; the data path is covered by the real-vLLM tests.
Needs root and iproute2 (and iptables for cut 2); without them the row says why it did not run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos_run import Ctx, Knobs, run_scenario
from chaos_stack import sim_stats

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.deploy.netns import IP, Cluster, NetnsError  # noqa: E402

__all__ = ["run_partition"]

_IPTABLES = shutil.which("iptables")


def _ip(*args: str) -> None:
    r = subprocess.run([IP, *args], capture_output=True, text=True, check=False, timeout=10)
    if r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _root_link(cluster: Cluster) -> str:
    """A veth from the root namespace onto the head's bridge; returns the root side's address."""
    head = cluster.head
    root_end, head_end = f"{cluster.prefix}r", f"{cluster.prefix}h"
    _ip("link", "add", root_end, "type", "veth", "peer", "name", head_end, "netns", head.netns)
    _ip("-n", head.netns, "link", "set", head_end, "master", "br0")
    _ip("-n", head.netns, "link", "set", head_end, "up")
    addr = f"{cluster.subnet}.254"
    _ip("addr", "add", f"{addr}/24", "dev", root_end)
    _ip("link", "set", root_end, "up")
    return addr


def _drop_between(ns: str, other: str, add: bool) -> bool:
    if _IPTABLES is None:
        return False
    op = "-A" if add else "-D"
    ok = True
    for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
        cmd = [IP, "netns", "exec", ns, _IPTABLES, op, chain, flag, other, "-j", "DROP"]
        ok = subprocess.run(cmd, capture_output=True, check=False, timeout=10).returncode == 0 and ok
    return ok


def _frees(ctx: Ctx) -> None:
    ctx.extra["prefill_frees"] = {p.name: (sim_stats(p.url) or {}).get("freed") for p in ctx.stack.prefills}


def run_partition(knobs: Knobs, results_dir: Path, *, pair_cut: bool | None = None) -> dict[str, Any]:
    name, title = "7-partition", "Network cut head<->engine host, then decode<->prefill"
    if os.geteuid() != 0 or not Path(IP).exists():
        return {"scenario": name, "title": title, "skipped": "needs root and iproute2"}
    pair_cut = knobs.partition_s >= 10 if pair_cut is None else pair_cut
    subnet = f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(250) + 1}"
    cluster = Cluster([("head", 1), ("eng1", 2), ("eng2", 3)], subnet=subnet)
    try:
        cluster.start()
        root_addr = _root_link(cluster)
    except (NetnsError, OSError) as exc:
        cluster.close()
        return {"scenario": name, "title": title, "skipped": f"network namespaces unavailable: {exc}"}
    hosts = {"metaserver": cluster.host("head"), "router": cluster.host("head")}
    hosts.update({"p0": cluster.host("eng1"), "d0": cluster.host("eng1")})
    hosts.update({"p1": cluster.host("eng2"), "d1": cluster.host("eng2")})

    def place(component: str) -> tuple[list[str], str]:
        if component == "redis":
            return [], root_addr
        h = hosts[component]
        return [IP, "netns", "exec", h.netns], h.addr

    def fault(ctx: Ctx) -> None:
        port = f"{cluster.prefix}v1"  # eng1's port on the bridge (hosts[1])
        _ip("-n", cluster.head.netns, "link", "set", port, "down")
        time.sleep(knobs.partition_s)
        _ip("-n", cluster.head.netns, "link", "set", port, "up")
        ctx.extra["cut_head_eng1_s"] = knobs.partition_s
        if pair_cut:
            eng1, eng2 = cluster.host("eng1"), cluster.host("eng2")
            applied = _drop_between(eng2.netns, eng1.addr, True)
            time.sleep(knobs.partition_s)
            _drop_between(eng2.netns, eng1.addr, False)
            ctx.extra["cut_d1_p0_s"] = knobs.partition_s if applied else "iptables unavailable"

    try:
        opts = {"place": place, "redis_args": ["--bind", "127.0.0.1", root_addr, "--protected-mode", "no"]}
        row = run_scenario(name, title, fault, knobs, results_dir=results_dir, stack_opts=opts, after=_frees)
    finally:
        cluster.close()
        row_left = cluster.leftovers()
    row["netns_leftovers"] = row_left
    return row

"""`pdgate doctor`: check a deployment before traffic or while it runs, one line per finding saying what
is wrong and how to fix it.

What it reads (`gather`, once): the metaserver's registry and /health, the router's admin /health (its
pool), and whatever each check asks itself (engines' /health and /version, a socket on the bind
address, Redis's clock). Every check (`checks.CHECKS`) is a small function of those `Facts` returning
its findings, each (status, message, fix): `ok`, `warn` (works, but read it), `fail` (requests fail or
will), `skip` (nothing to check, or not from here). Exit status 1 when any finding is a failure.

Why from the operator's host and not inside the services: the failures it looks for are between the
pieces (a metaserver bound to 127.0.0.1 while engines registered from other hosts, tokens that do not
match, an engine whose connector reports to another ledger), which no one piece sees whole.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pdgate.cli.client import Admin, CliError

__all__ = ["Facts", "Finding", "diagnose", "gather", "render"]

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Finding:
    """One line of the report: the check's verdict, what it saw, and what to do about it."""

    check: str
    status: Status
    message: str
    fix: str = ""


@dataclass
class Facts:
    """What the checks look at, read once. An `*_error` is why that source could not be read."""

    admin: Admin
    registry: list[dict[str, Any]] | None = None
    registry_error: str | None = None
    meta_health: dict[str, Any] | None = None
    router_health: dict[str, Any] | None = None
    router_error: str | None = None
    redis: str | None = None
    allowed_engine_networks: str | None = None
    side_channel_ports: str = "5600-5607"
    clock: Callable[[], float] = time.time  # this host's wall clock (the clock check compares it)


def gather(admin: Admin, args: argparse.Namespace) -> Facts:
    """Every source read once; a source that fails is recorded, not raised (its check reports it)."""
    f = Facts(
        admin=admin,
        redis=getattr(args, "redis", None),
        allowed_engine_networks=getattr(args, "allowed_engine_networks", None),
        side_channel_ports=getattr(args, "side_channel_ports", None) or "5600-5607",
    )
    if admin.s.meta_url is not None:
        try:
            f.registry = admin.instances()
        except CliError as exc:
            f.registry_error = str(exc)
        try:
            resp = admin.call("metaserver", "GET", "/health")
            f.meta_health = resp.json() if resp.status_code == 200 else {"status": resp.status_code}
        except (CliError, ValueError):
            f.meta_health = None
    else:
        f.registry_error = "no metaserver URL: give --metaserver or --router"
    if admin.s.router is not None:
        try:
            f.router_health = admin.router_health()
        except CliError as exc:
            f.router_error = str(exc)
    return f


def render(findings: list[Finding], output: str) -> str:
    if output == "json":
        return json.dumps([asdict(x) for x in findings], indent=2)
    lines = []
    for x in findings:
        line = f"{x.status.upper():4}  {x.check:10}  {x.message}"
        if x.fix and x.status in ("warn", "fail"):
            line += f"\n{'':16}fix: {x.fix}"
        lines.append(line)
    bad = sum(x.status == "fail" for x in findings)
    warn = sum(x.status == "warn" for x in findings)
    lines.append(f"\n{bad} failed, {warn} warnings, {len(findings) - bad - warn} ok or skipped")
    return "\n".join(lines)


def diagnose(admin: Admin, args: argparse.Namespace) -> list[Finding]:
    from pdgate.cli.checks import CHECKS

    facts = gather(admin, args)
    found: list[Finding] = []
    for check in CHECKS:
        try:
            found.extend(check(facts))
        except Exception as exc:  # a broken check is a finding, never a crash of the report
            found.append(Finding(check.__name__, "warn", f"the check itself failed: {type(exc).__name__}: {exc}"))
    return found

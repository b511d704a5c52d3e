"""`pdgate`: the operator's command, in the style of kubectl and redis-cli.

    pdgate instances [--role prefill] [--state draining]   the pool: registry record + the router's view
    pdgate handoffs [ID] [--state READY] [--counts]        live handoffs, their counts, or one handoff
    pdgate drain ID / pdgate undrain ID                    stop / resume giving an instance new work
    pdgate top [--once] [--interval S]                     live load, KV use, breakers, phase latencies
    pdgate doctor                                          checks a deployment, one line per finding
    pdgate config                                          the settings as read, and their file

Every subcommand takes the connection flags of `CliSettings` (`--router`, `--metaserver`, `--token`,
`--json`, ...), each also `PDGATE_CLI_<NAME>` (the rule of every pdgate command, `pdgate.settings`) or
a key of the config file (`pdgate.cli_config`). Exit status: 0 done (doctor: nothing failed), 1 a call
failed or doctor found a failure, 2 bad arguments or settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pdgate.cli import commands
from pdgate.cli.client import Admin, CliError
from pdgate.cli.settings import ENV_PREFIX, CliSettings, load_settings
from pydantic import ValidationError

from pdgate.settings import add_settings_flags, given, invalid_settings

__all__ = ["build_parser", "main"]

_OWN = (
    "command",
    "role",
    "state",
    "transfer_id",
    "instance_id",
    "once",
    "interval",
    "json",
    "redis",
    "allowed_engine_networks",
    "side_channel_ports",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdgate",
        description="Operate a pdgate deployment. Every connection flag is also an environment variable "
        f"{ENV_PREFIX}<NAME> or a key of the config file (pdgate config); a flag wins.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_settings_flags(p, CliSettings, env_prefix=ENV_PREFIX)
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="the same as --output json")
        return p

    p = command("instances", "the pool: each instance's registry record and the router's view of it")
    p.add_argument("--role", choices=("prefill", "decode", "both"))
    p.add_argument("--state", choices=("ready", "draining"))
    p = command("handoffs", "live handoffs (nearest lease end first), their counts by state, or one by id")
    p.add_argument("transfer_id", nargs="?")
    p.add_argument("--state", type=str.upper, choices=("PENDING", "READY", "CLAIMED"))
    p.add_argument("--limit", type=int, default=100, help="at most this many records (default 100, max 1000)")
    p.add_argument("--counts", action="store_true", help="only the number in each state (every record counted)")
    for verb, what in (("drain", "stop giving an instance new work"), ("undrain", "undo a drain")):
        command(verb, what).add_argument("instance_id")
    p = command("top", "live per-instance load, KV use, breaker state and phase latencies")
    p.add_argument("--once", action="store_true", help="print one screen and exit (latencies since start)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between screens (default 2)")
    p = command("doctor", "check a deployment: one line per check, what is wrong and how to fix it")
    p.add_argument("--redis", metavar="URL", help="the store's Redis, to check this host's clock against it")
    p.add_argument("--allowed-engine-networks", metavar="CIDRS", help="the router's, to name engines it leaves out")
    p.add_argument("--side-channel-ports", metavar="LO-HI", help="ports the engines' side channels take (5600-5607)")
    command("config", "the settings as read, and the config file they came from")
    return parser


def _runner(name: str) -> Callable[[Admin, argparse.Namespace], str]:
    table: dict[str, Callable[[Admin, argparse.Namespace], str]] = {
        "instances": commands.instances,
        "handoffs": commands.handoffs,
        "drain": commands.drain,
        "undrain": commands.drain,
        "top": commands.top,
    }
    return table[name]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = given(args, leave_out=_OWN)
    if getattr(args, "json", False):
        flags["output"] = "json"
    try:
        settings, path = load_settings(flags)
    except ValidationError as exc:
        print(f"pdgate: invalid settings: {invalid_settings(exc)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"pdgate: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(commands.config(settings, path))
        return 0
    if args.command == "doctor":
        from pdgate.cli.doctor import diagnose, render

        with Admin(settings) as admin:
            findings = diagnose(admin, args)
        print(render(findings, settings.output))
        return 1 if any(f.status == "fail" for f in findings) else 0
    try:
        with Admin(settings) as admin:
            out = _runner(args.command)(admin, args)
    except CliError as exc:
        print(f"pdgate {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(out)
    return 0

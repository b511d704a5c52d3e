"""The `pdgate` command's config file: where it lives and how a launcher writes one.

Why in the kernel: the local stack (`pdgate-local up`, deploy/local) writes the file for the stack it
started, and the command (`pdgate.cli`) reads it; neither package may import the other, so the one
rule of the file (its places, its keys, its mode) lives here.

The file is TOML with the settings of `pdgate.cli.settings.CliSettings` as top-level keys:

    router = "http://127.0.0.1:8000"       # the router's base URL
    metaserver = "http://127.0.0.1:8300"   # the metaserver's (absent: the router's, its embedded one)
    token = "..."                          # the admin token (the router's and the metaserver's)

It is looked for in `./.pdgate/cli.toml` (the local stack's, written where it was started), then in
`~/.config/pdgate/config.toml`; `--config` or `PDGATE_CLI_CONFIG` names another. Flags and
`PDGATE_CLI_*` variables win over it. Written with mode 600, since it holds a token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["CONFIG_ENV", "KEYS", "config_candidates", "find_config", "write_cli_config"]

CONFIG_ENV = "PDGATE_CLI_CONFIG"
KEYS = ("router", "metaserver", "token", "metaserver_token")
LOCAL_FILE = Path(".pdgate") / "cli.toml"
USER_FILE = Path(".config") / "pdgate" / "config.toml"


def config_candidates(cwd: Path | None = None, home: Path | None = None) -> tuple[Path, ...]:
    """Where the file is looked for, first found wins: the local stack's, then the user's."""
    return ((cwd or Path.cwd()) / LOCAL_FILE, (home or Path.home()) / USER_FILE)


def find_config(explicit: str | None = None) -> Path | None:
    """The config file to read: `explicit` (a flag) or `$PDGATE_CLI_CONFIG` when set (even if missing:
    the caller says so), else the first candidate that exists, else None."""
    named = explicit or os.environ.get(CONFIG_ENV)
    if named:
        return Path(named).expanduser()
    return next((p for p in config_candidates() if p.is_file()), None)


def write_cli_config(path: Path, **values: str | None) -> Path:
    """Write `values` (keys of `KEYS`; None left out) as the file at `path`, mode 600."""
    unknown = set(values) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; the file holds {KEYS}")
    # A JSON string is a TOML basic string for everything a URL or a token holds.
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# pdgate CLI settings (written by pdgate-local; see pdgate/cli_config.py)\n")
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return path

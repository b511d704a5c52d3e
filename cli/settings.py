"""`CliSettings`: where the `pdgate` command finds the deployment, and with which token.

Read, first found wins: a flag (`--router URL`), the environment (`PDGATE_CLI_ROUTER`, the rule of every
pdgate command), the config file (`pdgate.cli_config`: `./.pdgate/cli.toml` that `pdgate-local up`
writes, `~/.config/pdgate/config.toml`, or `--config FILE`), the defaults. `pdgate config` prints what
was read and from which file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdgate.cli_config import find_config
from pdgate.settings import reading_toml

__all__ = ["ENV_PREFIX", "CliSettings", "load_settings"]

ENV_PREFIX = "PDGATE_CLI_"


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    router: str | None = Field(
        None, description="the router's base URL (e.g. http://10.0.0.5:8000)", json_schema_extra={"metavar": "URL"}
    )
    metaserver: str | None = Field(
        None,
        description="the metaserver's base URL (absent: the router's, which embeds one when it has no --metaserver)",
        json_schema_extra={"metavar": "URL"},
    )
    token: str | None = Field(None, description="the admin token (router and metaserver)")
    metaserver_token: str | None = Field(None, description="the metaserver's admin token when it differs from --token")
    timeout_s: float = Field(5.0, gt=0, description="timeout of one HTTP call")
    output: Literal["table", "json"] = Field("table", description="table for people, json for scripts (or --json)")
    config: str | None = Field(
        None,
        description="config file (default: ./.pdgate/cli.toml, then ~/.config/pdgate/config.toml)",
        json_schema_extra={"metavar": "FILE"},
    )

    @property
    def meta_url(self) -> str | None:
        """The metaserver to ask: its own URL, else the router's (embedded metaserver)."""
        return self.metaserver or self.router

    @property
    def meta_token(self) -> str | None:
        return self.metaserver_token or self.token


def load_settings(flags: dict[str, Any]) -> tuple[CliSettings, Path | None]:
    """The settings from `flags` (those given), the environment and the config file; and the file read
    (None when there was none). A named file that does not exist is an error, not silence."""
    path = find_config(flags.get("config"))
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist (named by --config or PDGATE_CLI_CONFIG)")
    if path is None:
        return CliSettings(**flags), None
    return reading_toml(CliSettings, path)(**flags), path

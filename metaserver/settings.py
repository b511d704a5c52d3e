"""MetaSettings: the one settings object of the metaserver, read once at start-up.

Every field is settable as an environment variable `PDGATE_METASERVER_<FIELD>` (e.g.
`PDGATE_METASERVER_STORE`), the rule of every pdgate command (`PDGATE_<COMMAND>_<FLAG>`), or by its older
name `PDGATE_<FIELD>` (still read; the new name wins), and as a CLI flag `--<field-with-dashes>` (e.g.
`--store`); a flag wins over the environment. `parse_cli` builds the flags from the fields
(`pdgate.settings`, the one parser of every pdgate command), so `pdgate-metaserver --help` documents each
one with both its env names and its default, and a new field cannot be forgotten in the CLI. The older
names are the metaserver's alone (`settings_customise_sources` below), so they live here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from pdgate.auth import resolve_secret
from pdgate.models import MAX_BODY_BYTES
from pdgate.settings import parse_settings, settings_parser
from pdgate.urls import IPNetwork, parse_networks

__all__ = ["ENV_PREFIX", "MetaSettings", "build_parser", "parse_cli"]

ENV_PREFIX = "PDGATE_"  # the older names, still read
COMMAND_ENV_PREFIX = "PDGATE_METASERVER_"  # PDGATE_<COMMAND>_<FLAG>, as pdgate-router and pdgate-local


class MetaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """PDGATE_METASERVER_<FIELD> first, then the older PDGATE_<FIELD>."""
        command_env = EnvSettingsSource(settings_cls, env_prefix=COMMAND_ENV_PREFIX)
        return (init_settings, command_env, env_settings, dotenv_settings, file_secret_settings)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8300, ge=0, le=65535, description="port to listen on (0: any free port)")
    store: str = Field(
        "memory://",
        description="store URL: memory:// (embedded, one process); redis://host:port/db[?prefix=NAME] "
        "(one Redis; several metaserver replicas share it); "
        "redis+sentinel://h1:26379,h2:26379/MASTER/db[?prefix=NAME&wait_replicas=1] (follows a failover); "
        "redis+cluster://h1:7000,h2:7001/0[?prefix=NAME&buckets=64] (ledger sharded by prefill); "
        "rediss:// and rediss+... for TLS (docs/SCALE.md)",
    )
    admin_token: str | None = Field(
        None,
        description="token that every /v1 route needs as 'Authorization: Bearer TOKEN' (401 otherwise); "
        "prefer the environment or --admin-token-file to a flag (command lines are visible to every user). "
        "Unset: protected mode, /v1 routes answer loopback peers only",
    )
    admin_token_file: str | None = Field(
        None, description="file whose first line is the admin token (mode 600); instead of --admin-token"
    )
    auth_reads: bool = Field(
        True,
        description="reads of /v1 routes (instance URLs, KV locations) need the admin token too; "
        "--no-auth-reads opens them to anyone who can reach the port",
    )
    allowed_engine_networks: str | None = Field(
        None,
        description="comma-separated CIDRs (e.g. 10.0.0.0/8,fd00::/8): instance URLs whose host is not a "
        "literal address inside one of them are refused at registration",
    )
    instance_lease_s: float = Field(10.0, gt=0, description="heartbeat lease of an instance that names none")
    pending_lease_s: float = Field(60.0, gt=0, description="how long a handoff may stay PENDING (prefill running)")
    ready_lease_s: float = Field(30.0, gt=0, description="how long a READY handoff waits for a claim")
    claim_lease_s: float = Field(10.0, gt=0, description="claim lease when the claimer names none")
    max_claims: int = Field(
        3, ge=1, description="claims whose lease may lapse back to READY; the last lapse expires the handoff"
    )
    terminal_ttl_s: float = Field(600.0, gt=0, description="how long DONE/ABORTED/EXPIRED records stay readable")
    events_maxlen: int = Field(
        10000,
        ge=10,
        description="events kept per prefill instance (approximate trim); a slower reader misses older ones",
    )
    events_ttl_s: float = Field(3600.0, gt=0, description="an event feed with no new event for this long is dropped")
    sweep_interval_s: float = Field(0.1, gt=0, le=10, description="how often the sweeper expires lapsed leases")
    max_wait_s: float = Field(60.0, gt=0, description="cap on ?wait= of long-polls")
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413")
    max_long_polls: int = Field(
        1024, ge=1, description="concurrent long-polls (?wait=) this process holds; more get 429 with Retry-After"
    )
    header_timeout_s: float = Field(
        30.0, gt=0, description="a connection whose request headers are not complete within this is closed"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body that stalls (no bytes) for this long has its connection closed"
    )
    max_connections: int = Field(
        4096, ge=1, description="open connections beyond which new ones get 503 with Retry-After and are closed"
    )
    health_timeout_s: float = Field(2.0, gt=0, description="/health answers 503 when the store takes longer")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    access_log: bool = Field(False, description="uvicorn access log (one line per request)")
    fast_path: bool = Field(
        True, description="serve the hot ledger routes with a lean ASGI handler in front of FastAPI (same answers)"
    )

    @model_validator(mode="after")
    def _token_from_file(self) -> MetaSettings:
        """Read --admin-token-file once, here, so every user of the settings sees one `admin_token`."""
        token = resolve_secret(self.admin_token, self.admin_token_file, name="admin_token")
        if token != self.admin_token:
            object.__setattr__(self, "admin_token", token)
        if self.allowed_engine_networks:
            parse_networks(self.allowed_engine_networks)  # refuse a malformed CIDR at start-up
        return self

    @property
    def protected_mode(self) -> bool:
        """No admin token: /v1 routes answer loopback peers only (see pdgate.auth)."""
        return self.admin_token is None

    @property
    def engine_networks(self) -> tuple[IPNetwork, ...]:
        return parse_networks(self.allowed_engine_networks) if self.allowed_engine_networks else ()


def build_parser() -> argparse.ArgumentParser:
    """The flags of `pdgate-metaserver`, from the fields (pdgate.settings), each naming both env names."""
    return settings_parser(
        MetaSettings,
        prog="pdgate-metaserver",
        description="pdgate metaserver: instance registry and KV handoff ledger.",
        env_prefix=COMMAND_ENV_PREFIX,
        legacy_prefix=ENV_PREFIX,
    )


def parse_cli(argv: Sequence[str] | None = None) -> MetaSettings:
    """Flags given on the command line override the environment, which overrides the defaults."""
    return parse_settings(MetaSettings, build_parser(), argv)

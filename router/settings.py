"""RouterSettings: the one settings object of the router, read once at start-up.

Every field is an environment variable `PDGATE_ROUTER_<FIELD>` and a CLI flag `--<field-with-dashes>`
(a flag wins). `build_parser` derives the flags from the fields, so `pdgate-router --help` documents
each with its env var and default and a new field cannot be left out of the CLI. List fields are
repeatable flags (`--prefill URL --prefill URL`) or comma-separated env values.

The embedded metaserver (no `--metaserver`) takes `--store`, the admin token (when set here) and
`--allowed-engine-networks` from here and its other knobs, the admin token included, from its own
`PDGATE_METASERVER_*` variables or their older `PDGATE_*` names (see `pdgate-metaserver --help`).

Secrets (`admin_token`, `api_key`, `upstream_api_key`, `metaserver_token`) each have a `*_file` twin
and an environment variable: a value given as a flag is visible to every user of the host (`ps`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pdgate.auth import SecretFileError, read_secret_file, resolve_secret
from pdgate.settings import parse_settings, settings_parser
from pdgate.urls import InvalidEngineURL, IPNetwork, check_engine_url, parse_networks

__all__ = ["ENV_PREFIX", "POLICY_NAMES", "RouterSettings", "build_parser", "claim_budget_problem", "parse_cli"]

ENV_PREFIX = "PDGATE_ROUTER_"
POLICY_NAMES = ("round_robin", "least_load", "power_of_two", "prefix_affinity", "cache_aware")
PolicyName = Literal["round_robin", "least_load", "power_of_two", "prefix_affinity", "cache_aware"]
UrlList = Annotated[list[str], NoDecode]


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    workers: int = Field(1, ge=1, le=256, description="processes serving the port; > 1 needs a shared ledger")

    # -- where instances come from ----------------------------------------------------------
    metaserver: str | None = Field(
        None,
        description="metaserver base URL; when unset the router runs one in-process on --store and serves "
        "its /v1/instances and /v1/handoffs routes on this port",
    )
    metaserver_token: str | None = Field(
        None, description="admin token the router sends to --metaserver (prefer the environment or the file)"
    )
    metaserver_token_file: str | None = Field(
        None, description="file whose first line is --metaserver-token (mode 600)"
    )
    metaserver_timeout_s: float = Field(5.0, gt=0, description="timeout of one call to --metaserver")
    metaserver_connections: int = Field(
        256,
        ge=1,
        le=4096,
        description="most connections open to --metaserver at once; further ledger calls wait their turn "
        "(within --metaserver-timeout-s): one connection per in-flight request would pass the metaserver's "
        "own connection cap at a few thousand streams",
    )
    metaserver_batches: int = Field(
        2,
        ge=0,
        le=64,
        description="ledger batch requests (POST /v1/handoffs/batch) out to --metaserver at once: the creates, "
        "claims and aborts of requests in flight ride together in one request, so under load the router "
        "sends a few ledger requests, not two per client request; 0 sends each call on its own",
    )
    advertise_metaserver: str | None = Field(
        None,
        description="metaserver URL the engines can reach, sent to them in kv_transfer_params "
        "(default: --metaserver, or this router's own URL when embedded and --host is not a wildcard)",
    )
    store: str = Field("memory://", description="store of the embedded metaserver: memory:// or redis://...")
    admin_token: str | None = Field(
        None,
        description="admin token of the embedded metaserver's /v1/instances and /v1/handoffs routes and of the "
        "instance URLs in /health (default: PDGATE_METASERVER_ADMIN_TOKEN or PDGATE_ADMIN_TOKEN; unset: protected "
        "mode, loopback peers only); "
        "prefer the environment or --admin-token-file to a flag (command lines are visible to every user)",
    )
    admin_token_file: str | None = Field(None, description="file whose first line is the admin token (mode 600)")
    allowed_engine_networks: str | None = Field(
        None,
        description="comma-separated CIDRs (e.g. 10.0.0.0/8,fd00::/8): instance URLs whose host is not a literal "
        "address inside one of them are refused (static instances at start-up, registrations with 422)",
    )
    prefill: UrlList = Field(
        default_factory=list,
        description="static prefill instance base URL (repeatable)",
        json_schema_extra={"metavar": "URL"},
    )
    decode: UrlList = Field(
        default_factory=list,
        description="static decode instance base URL (repeatable)",
        json_schema_extra={"metavar": "URL"},
    )
    model: str | None = Field(
        None, description="model of the static instances (default: learned from their GET /v1/models)"
    )
    block_size: int | None = Field(None, ge=1, description="KV block size of the static instances (unset: any)")
    refresh_interval_s: float = Field(1.0, gt=0, description="how often the registry snapshot is refreshed")

    # -- routing ----------------------------------------------------------------------------
    prefill_policy: PolicyName = Field("prefix_affinity", description="how a prefill instance is chosen")
    decode_policy: PolicyName = Field("least_load", description="how a decode instance is chosen")
    prefix_chars: int = Field(256, ge=1, description="prefix_affinity: prompt characters hashed for affinity")
    kv_protocol: Literal["auto", "mooncake"] = Field(
        "auto",
        description="auto: prefill, then decode with the prefill's kv_transfer_params (pdgate's connector, "
        "vLLM's NixlConnector); mooncake: vLLM's MooncakeConnector, prefill and decode sent at once with the "
        "prefill's engine id from its bootstrap server (router/stock_mooncake.py, docs/MOONCAKE.md)",
    )
    mooncake_bootstrap_port: int = Field(
        8998, ge=1, le=65535, description="--kv-protocol mooncake: the prefills' VLLM_MOONCAKE_BOOTSTRAP_PORT"
    )
    prefix_load_factor: float = Field(
        1.25, ge=1.0, description="prefix_affinity: skip an instance above this multiple of the mean load"
    )
    kv_events: UrlList = Field(
        default_factory=list,
        json_schema_extra={"metavar": "ID=PUB[|REPLAY]"},
        description="follow instance ID's vLLM KV events (--kv-events-config, zmq publisher) at PUB, with its "
        "replay endpoint; cache_aware then knows what each instance holds (router/kv_events.py). Off by default",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="follow every registered instance's KV events at its URL's host, this port + its DP rank "
        "(vLLM's offset); --kv-events names win",
    )
    kv_events_replay_port: int | None = Field(
        None, ge=1, le=65535, description="with --kv-events-port: the engines' replay port (+ DP rank)"
    )
    kv_events_hash_seed: str = Field(
        "vllm-none-hash", description="the engines' PYTHONHASHSEED when they set one (their block hashes' seed)"
    )
    kv_events_max_blocks: int = Field(
        1 << 20, ge=1, description="blocks indexed per instance at most (about 70 MiB per million)"
    )
    disaggregation: Literal["always", "conditional", "never"] = Field(
        "always",
        description="PD for every request (always), by the decider's rules (conditional: router/decider.py), "
        "or never (each request whole on a decode)",
    )
    pd_min_tokens: int = Field(
        1024, ge=0, description="conditional: non-cached prompt tokens from which a request goes PD"
    )
    pd_prefill_busy_load: float = Field(
        8.0,
        gt=0,
        description="conditional: a prefill this loaded (running + queued, weighted as the policies weigh "
        "them) and busier than the decode makes a long prompt run whole",
    )
    pd_prefill_kv_full: float = Field(
        0.9,
        gt=0,
        le=1,
        description="conditional: a prefill whose reported KV-cache use (0-1) is this high and above the "
        "decode's makes a long prompt run whole",
    )
    whole_on: Literal["any", "decode"] = Field(
        "any",
        description="conditional/never: where a request the decider keeps whole runs: any (the instance of "
        "either side the decode policy picks: a prefill's core is idle between prompts) or decode (decodes "
        "only, the prefills kept for PD prompts). A PD request that failed goes whole on a decode either way",
    )

    # -- clients ----------------------------------------------------------------------------
    api_key: UrlList = Field(
        default_factory=list,
        json_schema_extra={"metavar": "KEY"},
        description="client API key accepted as 'Authorization: Bearer KEY' (repeatable; prefer the "
        "environment or --api-key-file)",
    )
    api_key_file: str | None = Field(None, description="file of client API keys, one per line (mode 600)")
    upstream_api_key: str | None = Field(
        None,
        description="key sent to engines as 'Authorization: Bearer KEY' (default: no Authorization header; "
        "prefer the environment or --upstream-api-key-file)",
    )
    upstream_api_key_file: str | None = Field(
        None, description="file whose first line is --upstream-api-key (mode 600)"
    )
    forward_client_auth: bool = Field(
        False,
        description="send the client's own Authorization header to the engines when no --upstream-api-key is "
        "set (off: client credentials never leave the router)",
    )
    max_inflight: int = Field(4096, ge=1, description="requests in flight beyond which clients get 429")
    max_fan_out: int = Field(
        1024,
        ge=1,
        description="most engine requests one client request may cause (prompts x n; each counts against "
        "--max-inflight); a request asking more gets 400 pd_unsupported_parameter before any engine work",
    )
    max_body_bytes: int = Field(32 << 20, ge=1024, description="larger request bodies get 413")
    header_timeout_s: float = Field(
        30.0, gt=0, description="a connection whose request headers are not complete within this is closed"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body that stalls (no bytes) for this long has its connection closed"
    )
    max_connections: int = Field(
        8192, ge=1, description="open client connections beyond which new ones get 503 and are closed"
    )

    first_token_from_prefill: bool = Field(
        True,
        description="stream a completion's first token as soon as the prefill has it; the decode continues "
        "after it (router/first_token.py says which requests qualify; off: the decode sends every token)",
    )

    # -- failures ---------------------------------------------------------------------------
    prefill_retries: int = Field(2, ge=0, description="retries of a failed prefill on another instance")
    decode_retries: int = Field(2, ge=0, description="retries of a decode that failed before its first byte")
    retry_backoff_s: float = Field(0.01, ge=0, description="first retry delay (doubles, jittered)")
    retry_backoff_max_s: float = Field(0.5, ge=0, description="largest retry delay")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout to engines")
    prefill_timeout_s: float = Field(600.0, gt=0, description="prefill: longest silence before giving up")
    decode_timeout_s: float = Field(600.0, gt=0, description="decode: longest wait for the first byte")
    first_byte_factor: float = Field(
        4.0,
        ge=0,
        description="a streamed decode that has not sent its first chunk within max(--first-byte-floor-s, this "
        "x the recent p99 of the decodes' first chunks), bounded by --decode-timeout-s, is re-sent to another "
        "decode (router/stall.py); 0: --decode-timeout-s alone",
    )
    first_byte_floor_s: float = Field(
        2.0, gt=0, description="the shortest first-chunk timeout --first-byte-factor may give a streamed decode"
    )
    stream_idle_timeout_s: float = Field(600.0, gt=0, description="decode: longest silence between stream chunks")
    handoff_lease_s: float | None = Field(
        None, gt=0, description="lease of the PENDING handoff the router creates (default: the metaserver's)"
    )
    health_interval_s: float = Field(5.0, gt=0, description="how often each instance's GET /health is probed")
    health_timeout_s: float = Field(2.0, gt=0, description="timeout of one health probe")
    health_timeouts_to_fail: int = Field(
        3,
        ge=1,
        le=100,
        description="health probes that time out in a row before an instance leaves rotation (a refused or "
        "failing probe takes it out at once)",
    )
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open an instance's breaker")
    breaker_open_s: float = Field(10.0, gt=0, description="how long an open breaker rejects before a probe")
    breaker_successes: int = Field(1, ge=1, description="successful probes that close a half-open breaker")
    on_ledger_outage: Literal["serve-whole", "refuse"] = Field(
        "serve-whole",
        description="when the metaserver or its store cannot be used, or no prefill/decode pair is live for "
        "the model: serve-whole sends the request end to end to one instance (a decode first, a prefill if "
        "no decode is live; answer header X-PDGate-Path: whole), refuse answers the typed error (router/whole.py)",
    )
    whole_on_failure: bool = Field(
        True,
        description="a request whose prefill or decode attempts all failed before a byte reached the client "
        "is served end to end by an instance left (router/whole.py); off: the client gets the typed error",
    )
    both_path: Literal["pd", "whole"] = Field(
        "pd",
        description="how instances of role both serve a request while no instance of role prefill is live for "
        "the model: pd (prefill on one, decode on another) or whole (end to end on one: a colocated pool)",
    )
    max_resumes: int = Field(
        2,
        ge=0,
        le=16,
        description="times a stream whose engine died, stalled or failed after its first byte is resumed on "
        "another instance (prompt + the tokens sent so far; router/resume.py); 0: the stream ends with the error",
    )

    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP collector (e.g. http://collector:4318): the router exports one span per request, "
        "with its prefill and decode phases, and the engines' spans join it (needs pdgate[tracing]); unset: "
        "an incoming traceparent still goes to both engines",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    access_log: bool = Field(False, description="uvicorn access log (one line per request)")

    @field_validator("prefill", "decode", "api_key", "kv_events", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for url in v:
            try:
                out.append(check_engine_url(url))
            except InvalidEngineURL as exc:
                raise ValueError(f"instance URL {url!r}: {exc}") from None
        return out

    @field_validator("metaserver", "advertise_metaserver", "otlp_traces_endpoint")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError(f"URL must start with http:// or https://: {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _backoff(self) -> RouterSettings:
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError("retry_backoff_max_s must be >= retry_backoff_s")
        return self

    @model_validator(mode="after")
    def _secrets_and_networks(self) -> RouterSettings:
        """Read every secret file once, here, so the rest of the router sees plain values."""
        try:
            resolved = {
                "admin_token": resolve_secret(self.admin_token, self.admin_token_file, name="admin_token"),
                "upstream_api_key": resolve_secret(
                    self.upstream_api_key, self.upstream_api_key_file, name="upstream_api_key"
                ),
                "metaserver_token": resolve_secret(
                    self.metaserver_token, self.metaserver_token_file, name="metaserver_token"
                ),
            }
            keys = [k for k in self.api_key if k]
            if self.api_key_file is not None:
                read_secret_file(self.api_key_file)  # the same checks: exists, not empty, mode 600
                text = Path(self.api_key_file).read_text(encoding="utf-8")
                keys += [line.strip() for line in text.splitlines() if line.strip()]
        except SecretFileError as exc:
            raise ValueError(str(exc)) from None
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "api_key", keys)
        nets = self.engine_networks
        for url in (*self.prefill, *self.decode):
            try:
                check_engine_url(url, nets)
            except InvalidEngineURL as exc:
                raise ValueError(f"instance URL {url!r}: {exc}") from None
        return self

    @property
    def engine_networks(self) -> tuple[IPNetwork, ...]:
        return parse_networks(self.allowed_engine_networks) if self.allowed_engine_networks else ()

    @property
    def embedded(self) -> bool:
        return self.metaserver is None

    def engine_metaserver_url(self, bound_port: int | None = None) -> str | None:
        """The metaserver URL engines are told about, if one is known."""
        if self.advertise_metaserver:
            return self.advertise_metaserver
        if self.metaserver:
            return self.metaserver
        if self.host in ("0.0.0.0", "::", ""):
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{bound_port or self.port}"


def build_parser() -> argparse.ArgumentParser:
    """The flags of `pdgate-router`, from the fields (pdgate.settings)."""
    return settings_parser(
        RouterSettings,
        prog="pdgate-router",
        description="pdgate router: OpenAI-compatible front door for prefill/decode disaggregated vLLM.",
        env_prefix=ENV_PREFIX,
    )


def parse_cli(argv: Sequence[str] | None = None) -> RouterSettings:
    """Flags given on the command line override the environment, which overrides the defaults."""
    return parse_settings(RouterSettings, build_parser(), argv)


def claim_budget_problem(decode_retries: int, max_claims: int) -> str | None:
    """Why a router with `decode_retries` cannot work with a ledger that allows `max_claims`, or None.

    Each decode retry takes the claim back from the decode it gave up on, and that claim's lapse spends one
    of the record's `max_claims` requeues; the lapse after the last one expires the handoff. So with
    `decode_retries >= max_claims` the last retry can only find its KV gone (pd_kv_expired)."""
    if decode_retries < max_claims:
        return None
    return (
        f"--decode-retries {decode_retries} needs the metaserver's --max-claims above it (it is {max_claims}): each "
        "retry takes a claim back, and the lapse after the last allowed claim expires the handoff; lower "
        "PDGATE_ROUTER_DECODE_RETRIES or raise PDGATE_METASERVER_MAX_CLAIMS"
    )

"""pdgate-sim's knobs: the settings (env + CLI), the fault script in force, and the counters tests read."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdgate.models import TransportKind
from pdgate.settings import parse_settings, settings_parser

__all__ = ["Script", "SimSettings", "Stats", "parse_cli"]


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PDGATE_SIM_", extra="ignore", frozen=True)

    role: Literal["prefill", "decode", "both"] = Field("both", description="which side of PD this engine serves")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8100, ge=0, le=65535, description="port to listen on")
    metaserver: str | None = Field(None, description="metaserver URL: register there and use it as the ledger")
    admin_token: str | None = Field(
        None, description="admin token for the metaserver's write routes (set it in the environment, not as a flag)"
    )
    metaserver_timeout_s: float = Field(5.0, gt=0, description="timeout of one call to the metaserver")
    advertise_url: str | None = Field(None, description="URL the router reaches this engine at (default host:port)")
    model: str = Field("sim-model", description="served model name")
    instance_id: str | None = Field(None, description="instance id (default: derived from the advertised URL)")
    block_size: int = Field(16, ge=1, description="KV block size advertised")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks (one registry record each)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size advertised")
    kv_dtype: str | None = Field(None, description="KV dtype advertised (absent: pairs with any)")
    kv_layout: str | None = Field(None, description="KV layout tag advertised (absent: pairs with any)")
    kv_replicated: bool = Field(False, description="advertise KV replicated on every TP rank")
    transport: TransportKind = Field(TransportKind.SIM, description="transport kind advertised")
    token_ids: bool = Field(
        False,
        description="character tokenizer for completions and chats (a chat's template: its contents joined by "
        "newlines): prompt ids are code points, outputs continue after output ids at a prompt's end, and "
        "return_token_ids is answered (sim/wire.py; off: prompts count in "
        "words and token ids are never shown, as the tests written before it expect)",
    )
    max_model_len: int = Field(32768, ge=2, description="prompt + max_tokens above this get 400, like vLLM")
    lease_s: float = Field(10.0, gt=0, description="registry lease; heartbeats every third of it")
    claim_wait_s: float = Field(30.0, gt=0, description="decode: longest wait for the handoff to be claimable")
    claim_lease_s: float | None = Field(None, gt=0, description="decode: claim lease asked for")
    prefill_delay: float = Field(0.0, ge=0, description="seconds a prefill takes")
    token_delay: float = Field(0.0, ge=0, description="seconds between decode tokens")
    decode_delay: float = Field(0.0, ge=0, description="seconds a decode waits before claiming")
    fail_first: int = Field(0, ge=0, description="the next N requests fail with --fail-status")
    fail_status: int = Field(503, ge=400, le=599, description="status of scripted failures")
    fail_rate: float = Field(0.0, ge=0, le=1, description="fraction of requests that fail, evenly spaced")
    die_after_tokens: int | None = Field(None, ge=0, description="drop the connection after N decode tokens")
    hang: bool = Field(False, description="never answer completions (until the client goes away)")
    no_kv_params: bool = Field(False, description="prefill answers without kv_transfer_params")
    unhealthy: bool = Field(False, description="GET /health answers 503")
    health_delay: float = Field(0.0, ge=0, le=600, description="seconds GET /health waits before answering")
    hold_until: int = Field(0, ge=0, description="hold requests until this many are in flight together (max 60 s)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("warning", description="log level")


@dataclass
class Script:
    """The faults and delays in force; `POST /sim/script` replaces any subset."""

    prefill_delay: float = 0.0
    token_delay: float = 0.0
    decode_delay: float = 0.0
    fail_first: int = 0
    fail_status: int = 503
    fail_rate: float = 0.0
    die_after_tokens: int | None = None
    hang: bool = False
    no_kv_params: bool = False
    unhealthy: bool = False
    health_delay: float = 0.0
    hold_until: int = 0  # hold every request until this many are in flight at once (max 60 s)

    @classmethod
    def from_settings(cls, s: SimSettings) -> Script:
        return cls(**{f.name: getattr(s, f.name) for f in fields(cls)})

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"unknown script fields: {', '.join(sorted(unknown))}")
        for k, v in changes.items():
            setattr(self, k, v)


class Stats:
    """The counters tests read at `GET /sim/stats`; `POST /sim/reset` zeroes all but the in-flight ones."""

    def __init__(self, dp_size: int) -> None:
        self.inflight = [0] * dp_size
        self.reset()

    def reset(self) -> None:
        self.counts: dict[str, int] = {}
        self.by_rank = [0] * len(self.inflight)
        self.max_inflight = 0
        self.log: deque[dict[str, Any]] = deque(maxlen=8192)

    def inc(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def snapshot(self, with_log: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "counts": self.counts,
            "by_rank": self.by_rank,
            "inflight": self.inflight,
            "max_inflight": self.max_inflight,
        }
        if with_log:
            out["log"] = list(self.log)
        return out


def parse_cli(argv: Sequence[str] | None = None) -> SimSettings:
    parser = settings_parser(
        SimSettings,
        prog="pdgate-sim",
        description="pdgate-sim: a fake vLLM prefill/decode engine for tests and benchmarks.",
        env_prefix="PDGATE_SIM_",
    )
    return parse_settings(SimSettings, parser, argv)

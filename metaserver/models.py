"""The data contracts shared by the metaserver, the router and the connector.

This is the only module that defines the shape of an instance record, a handoff record and the
bodies of the metaserver's routes. The router and the connector import these models; nobody rebuilds
them as dicts, so a field renamed here is renamed everywhere (or fails type checking).

CONTRACT_VERSION history:
  1: first version (registry + handoff ledger + event feed).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CONTRACT_VERSION",
    "TERMINAL_STATES",
    "AbortBody",
    "ClaimBody",
    "DoneBody",
    "Handoff",
    "HandoffCreate",
    "HandoffEvent",
    "HandoffEvents",
    "HandoffState",
    "HeartbeatBody",
    "HeartbeatResponse",
    "Instance",
    "InstanceLoad",
    "InstanceRegistration",
    "InstanceState",
    "KVLocation",
    "Problem",
    "RegisterResponse",
    "Role",
    "TransportAddress",
    "TransportKind",
]

CONTRACT_VERSION = 1

# Ids travel in URL paths and Redis keys: keep them URL-safe and bounded so a key can never be
# forged to collide with another record's key.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)
Ident = Annotated[str, Field(pattern=ID_PATTERN, description="URL-safe id, 1-128 characters")]

MAX_KV_KEY = 2**63 - 1


def is_valid_id(value: str) -> bool:
    """True when `value` may be used as an instance or transfer id."""
    return bool(_ID_RE.match(value))


class _Model(BaseModel):
    # Unknown fields are refused: a typo in a client must fail loudly, not be dropped silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # serves either side (e.g. a kv_both engine, or a simulator used for both)

    def can_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.BOTH)

    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.BOTH)


class InstanceState(str, Enum):
    READY = "ready"  # takes new work
    DRAINING = "draining"  # finishes what it has; gets no new work


class TransportKind(str, Enum):
    NIXL = "nixl"  # NIXL/UCX: GPU hosts and the portable CPU path
    LLMDATADIST = "llmdatadist"  # CANN llm_datadist on Ascend NPUs
    SIM = "sim"  # pdgate-sim engines: no bytes move


class HandoffState(str, Enum):
    PENDING = "PENDING"  # router created it; prefill not finished yet
    READY = "READY"  # prefill recorded where the KV lives; waiting for a decode to claim it
    CLAIMED = "CLAIMED"  # one decode holds it and is pulling; its claim lease may lapse back to READY
    DONE = "DONE"  # decode pulled the KV; prefill may free the blocks
    ABORTED = "ABORTED"  # someone gave up (client disconnect, failed pull); prefill frees the blocks
    EXPIRED = "EXPIRED"  # a lease lapsed with nobody acting; prefill frees the blocks

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[HandoffState] = frozenset({HandoffState.DONE, HandoffState.ABORTED, HandoffState.EXPIRED})


class TransportAddress(_Model):
    """Where one tensor-parallel rank of an instance can be reached by a transport.

    Fields are optional because each transport needs a different subset: NIXL needs `host`/`port`
    and the opaque agent description in `meta`; llm_datadist needs the device fields (and the A3
    super-pod fields on Atlas A3).
    """

    tp_rank: int = Field(0, ge=0)
    host: str | None = None
    port: int | None = Field(None, ge=0, le=65535)
    device_id: int | None = Field(None, ge=0)
    device_ip: str | None = None
    cluster_id: int | None = Field(None, ge=0)
    super_device_id: int | None = Field(None, ge=0)
    super_pod_id: str | None = None
    # Transport-specific, opaque to the control plane (e.g. NIXL agent name, base64 agent metadata,
    # registered region layout). Bounded by the body size limit of the metaserver.
    meta: dict[str, Any] = Field(default_factory=dict)


class InstanceLoad(_Model):
    running: int = Field(0, ge=0)
    waiting: int = Field(0, ge=0)
    kv_usage: float = Field(0.0, ge=0.0, le=1.0)


class InstanceRegistration(_Model):
    """Body of `POST /v1/instances`: everything the router needs to pair and address an instance.

    One record per data-parallel rank: a vLLM server with dp_size N registers N records that share
    `url` and differ in `dp_rank`, so load and health are tracked per rank.
    """

    id: Ident
    role: Role
    url: str = Field(..., min_length=1, max_length=2048, description="base URL, e.g. http://10.0.0.5:8100")
    model: str = Field(..., min_length=1, max_length=512)
    dp_rank: int = Field(0, ge=0)
    dp_size: int = Field(1, ge=1, le=4096)
    tp_size: int = Field(1, ge=1, le=4096)
    pp_size: int = Field(1, ge=1, le=4096)
    block_size: int = Field(16, ge=1, le=1 << 20)
    kv_dtype: str = Field("auto", max_length=64)
    kv_layout: str = Field("", max_length=128, description="layout tag; P and D must match")
    kv_replicated: bool = Field(
        False, description="KV identical on every TP rank (MLA): lets a D with smaller TP pull from P"
    )
    transport: TransportKind = TransportKind.NIXL
    transport_addresses: list[TransportAddress] = Field(default_factory=list, max_length=4096)
    engine_id: str | None = Field(None, max_length=256)
    server_id: str | None = Field(None, max_length=256)
    super_pod_id: str | None = Field(None, max_length=256)
    labels: dict[str, str] = Field(default_factory=dict)
    lease_s: float | None = Field(None, gt=0, le=3600, description="heartbeat lease; server default if absent")
    load: InstanceLoad = Field(default_factory=InstanceLoad)

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("url must start with http:// or https://")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _ranks(self) -> InstanceRegistration:
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} must be < dp_size {self.dp_size}")
        for addr in self.transport_addresses:
            if addr.tp_rank >= self.tp_size:
                raise ValueError(f"transport address tp_rank {addr.tp_rank} must be < tp_size {self.tp_size}")
        return self


class Instance(InstanceRegistration):
    """A registry record as stored and returned."""

    state: InstanceState = InstanceState.READY
    lease_s: float = Field(..., gt=0)  # type: ignore[assignment]
    registered_at: float
    last_heartbeat: float
    contract_version: int = CONTRACT_VERSION

    @property
    def expires_at(self) -> float:
        return self.last_heartbeat + self.lease_s


class RegisterResponse(_Model):
    lease_s: float
    instance: Instance


class HeartbeatBody(_Model):
    load: InstanceLoad | None = None


class HeartbeatResponse(_Model):
    lease_s: float
    state: InstanceState


class KVLocation(_Model):
    """Where a finished prefill's KV lives (the body of `PUT /v1/handoffs/{tid}/ready`)."""

    block_ids: list[list[int]] = Field(..., max_length=64, description="block ids per KV cache group")
    num_tokens: int = Field(..., ge=0)
    engine_id: str | None = Field(None, max_length=256)
    host: str | None = Field(None, max_length=256)
    dp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    block_size: int | None = Field(None, ge=1)
    kv_dtype: str | None = Field(None, max_length=64)
    kv_layout: str | None = Field(None, max_length=128)
    transport: TransportKind | None = None
    transport_addresses: list[TransportAddress] = Field(default_factory=list, max_length=4096)
    remote_request_id: str | None = Field(None, max_length=512, description="P's internal vLLM request id")

    @field_validator("block_ids")
    @classmethod
    def _non_negative(cls, v: list[list[int]]) -> list[list[int]]:
        for group in v:
            if any(b < 0 for b in group):
                raise ValueError("block ids must be >= 0")
        return v


class HandoffCreate(_Model):
    prefill_instance_id: Ident
    transfer_id: Ident | None = None
    lease_s: float | None = Field(None, gt=0, le=3600)
    request_id: str | None = Field(None, max_length=512, description="client X-Request-Id, for logs")


class ClaimBody(_Model):
    decode_instance_id: Ident
    lease_s: float | None = Field(None, gt=0, le=3600)


class DoneBody(_Model):
    decode_instance_id: Ident | None = None


class AbortBody(_Model):
    reason: str = Field("aborted", max_length=1024)


class Handoff(_Model):
    """One handoff ledger record, keyed by `transfer_id`."""

    transfer_id: str
    kv_key: int = Field(..., ge=1, le=MAX_KV_KEY)
    state: HandoffState
    prefill_instance_id: str
    decode_instance_id: str | None = None
    location: KVLocation | None = None
    request_id: str | None = None
    reason: str | None = None
    created_at: float
    updated_at: float
    deadline: float | None = Field(None, description="epoch seconds at which the current lease lapses")
    lease_s: float
    claims: int = 0
    contract_version: int = CONTRACT_VERSION


class HandoffEvent(_Model):
    """A terminal transition, delivered on the prefill instance's event feed."""

    transfer_id: str
    kv_key: int
    state: HandoffState
    reason: str | None = None
    at: float


class HandoffEvents(_Model):
    events: list[HandoffEvent]
    cursor: str


class Problem(BaseModel):
    """RFC 7807 problem details, as every metaserver error answers (`application/problem+json`).

    `code` is stable and machine-readable; `current_state` is set on 409/410 answers about handoffs.
    """

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    code: str
    current_state: HandoffState | None = None

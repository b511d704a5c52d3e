"""The data contracts shared by the metaserver, the router and the connector.

This is the only module that defines the shape of an instance record, a handoff record and the
bodies of the metaserver's routes. The router and the connector import these models; nobody rebuilds
them as dicts, so a field renamed here is renamed everywhere (or fails type checking).

CONTRACT_VERSION history:
  1: first version (registry + handoff ledger + event feed).
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from pdgate.urls import check_engine_url

__all__ = [
    "CONTRACT_VERSION",
    "KV_ROLES",
    "MAX_BATCH_ITEMS",
    "MAX_BODY_BYTES",
    "TERMINAL_STATES",
    "AbortBody",
    "BatchAbort",
    "BatchBody",
    "BatchClaim",
    "BatchCreate",
    "BatchDone",
    "BatchItem",
    "BatchOutcome",
    "BatchReady",
    "BatchResults",
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

# Every integer a client sends is at most 2**53 - 1: exact in a double, so in JSON parsers of every
# language, in orjson and in Redis Lua (cjson). A larger one would be stored, then fail to re-encode
# (a 5xx on every later read of the record): it is refused at the door instead.
MAX_SAFE_INT = 2**53 - 1
Count = Annotated[int, Field(ge=0, le=MAX_SAFE_INT)]

# Free-form metadata (transport `meta`) is opaque to the control plane but still bounded: JSON scalars,
# lists and objects only, nested at most META_MAX_DEPTH deep, at most META_MAX_ITEMS entries in all,
# strings up to META_MAX_STRING characters.
META_MAX_DEPTH = 8
META_MAX_ITEMS = 4096
META_MAX_STRING = 256 * 1024
META_MAX_KEY = 256


def _check_meta_value(value: Any, depth: int, budget: list[int], where: str) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"metadata has more than {META_MAX_ITEMS} entries")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INT:
            raise ValueError(f"{where}: integer beyond +-(2**53 - 1)")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: number must be finite")
        return
    if isinstance(value, str):
        if len(value) > META_MAX_STRING:
            raise ValueError(f"{where}: string longer than {META_MAX_STRING} characters")
        return
    if depth >= META_MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {META_MAX_DEPTH} levels")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_meta_value(item, depth + 1, budget, f"{where}.{i}")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > META_MAX_KEY:
                raise ValueError(f"{where}: keys are strings of at most {META_MAX_KEY} characters")
            _check_meta_value(item, depth + 1, budget, f"{where}.{key}")
        return
    raise ValueError(f"{where}: {type(value).__name__} is not a JSON value")


def _bounded_meta(value: dict[str, Any]) -> dict[str, Any]:
    _check_meta_value(value, 0, [META_MAX_ITEMS], "meta")
    return value


Meta = Annotated[dict[str, Any], AfterValidator(_bounded_meta)]
Labels = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=1024)]],
    Field(max_length=64),
]


def is_valid_id(value: str) -> bool:
    """True when `value` may be used as an instance or transfer id."""
    return bool(_ID_RE.match(value))


class _Model(BaseModel):
    # Unknown fields are refused: a typo in a client must fail loudly, not be dropped silently.
    # The metaserver reads every request body in pydantic's strict JSON mode (`metaserver.api.parse_body`,
    # `metaserver.batch.parse_batch`): "10" or true is no number, [[true]] no block id. Clients building
    # these models in Python keep the lax mode, so what they send is always of the declared type.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # serves either side (e.g. a kv_both engine, or a simulator used for both)

    def can_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.BOTH)

    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.BOTH)


# vLLM's kv_role -> the registry role: the connector registers by it, `pdgate doctor` checks by it.
KV_ROLES: dict[str, Role] = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE, "kv_both": Role.BOTH}


class InstanceState(str, Enum):
    READY = "ready"  # takes new work
    DRAINING = "draining"  # finishes what it has; gets no new work


class TransportKind(str, Enum):
    NIXL = "nixl"  # NIXL/UCX: GPU hosts and the portable CPU path
    MOONCAKE = "mooncake"  # Mooncake transfer engine: tcp on CPU, rdma, ascend on NPUs
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

    tp_rank: int = Field(0, ge=0, le=4095)
    host: str | None = Field(None, max_length=256)
    port: int | None = Field(None, ge=0, le=65535)
    device_id: Count | None = None
    device_ip: str | None = Field(None, max_length=64)
    cluster_id: Count | None = None
    super_device_id: Count | None = None
    super_pod_id: str | None = Field(None, max_length=256)
    # Transport-specific, opaque to the control plane (e.g. NIXL agent name, base64 agent metadata,
    # registered region layout); bounded in shape (`Meta`) and by the body size limit.
    meta: Meta = Field(default_factory=dict)


class InstanceLoad(_Model):
    running: Count = 0
    waiting: Count = 0
    kv_usage: float = Field(0.0, ge=0.0, le=1.0)


class InstanceRegistration(_Model):
    """Body of `POST /v1/instances`: everything the router needs to pair and address an instance.

    One record per data-parallel rank: a vLLM server with dp_size N registers N records that share
    `url` and differ in `dp_rank`, so load and health are tracked per rank.
    """

    id: Ident
    role: Role
    url: str = Field(
        ...,
        min_length=1,
        max_length=2048,
        description="base URL http[s]://host[:port] (port 1-65535; no user, path, query or fragment)",
    )
    model: str = Field(..., min_length=1, max_length=512)
    dp_rank: int = Field(0, ge=0, le=4095)
    dp_size: int = Field(1, ge=1, le=4096)
    tp_size: int = Field(1, ge=1, le=4096)
    pp_size: int = Field(1, ge=1, le=4096)
    block_size: int = Field(16, ge=1, le=1 << 20)
    # None (not stated) is the only "any" of the pairing rule (`pdgate.contract.mismatch`): a default of
    # "auto" or "" would be a value, and a registrant that left these out would never pair with an engine
    # that states its resolved dtype (bfloat16) or its layout tag.
    kv_dtype: str | None = Field(None, max_length=64, description="KV dtype; absent: pairs with any")
    kv_layout: str | None = Field(None, max_length=128, description="layout tag; P and D must match; absent: any")
    kv_replicated: bool = Field(
        False, description="KV identical on every TP rank (MLA): lets a D with smaller TP pull from P"
    )
    transport: TransportKind = TransportKind.NIXL
    transport_addresses: list[TransportAddress] = Field(default_factory=list, max_length=4096)
    engine_id: str | None = Field(None, max_length=256)
    server_id: str | None = Field(None, max_length=256)
    super_pod_id: str | None = Field(None, max_length=256)
    labels: Labels = Field(default_factory=dict)
    lease_s: float | None = Field(None, gt=0, le=3600, description="heartbeat lease; server default if absent")
    load: InstanceLoad = Field(default_factory=InstanceLoad)

    @field_validator("url")
    @classmethod
    def _url_rule(cls, v: str) -> str:
        return check_engine_url(v)

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
    lease_s: float = Field(..., gt=0)
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

    block_ids: list[list[Count]] = Field(..., max_length=64, description="block ids per KV cache group")
    num_tokens: Count
    engine_id: str | None = Field(None, max_length=256)
    host: str | None = Field(None, max_length=256)
    dp_rank: int = Field(0, ge=0, le=4095)
    tp_size: int = Field(1, ge=1, le=4096)
    block_size: int | None = Field(None, ge=1, le=1 << 20)
    kv_dtype: str | None = Field(None, max_length=64)
    kv_layout: str | None = Field(None, max_length=128)
    transport: TransportKind | None = None
    transport_addresses: list[TransportAddress] = Field(default_factory=list, max_length=4096)
    remote_request_id: str | None = Field(None, max_length=512, description="P's internal vLLM request id")


class HandoffCreate(_Model):
    prefill_instance_id: Ident
    transfer_id: Ident | None = None
    lease_s: float | None = Field(None, gt=0, le=3600)
    request_id: str | None = Field(None, max_length=512, description="client X-Request-Id, for logs")


class ClaimBody(_Model):
    decode_instance_id: Ident
    lease_s: float | None = Field(None, gt=0, le=3600)


class DoneBody(_Model):
    # Required: DONE frees the prefill's blocks, so the decode says who it is (the claimant check needs it).
    decode_instance_id: Ident


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


# -- batches (`POST /v1/handoffs/batch`) ----------------------------------------------------------
# Why: the engines' control threads and the router make many ledger calls at once; one HTTP request
# carrying all of them costs the metaserver one request's overhead, and the store pipelines the items.
# Each item is one of the single routes' bodies plus its `op` and `transfer_id`, answered on its own.

MAX_BATCH_ITEMS = 512
# The metaserver's default request-body limit (`MetaSettings.max_body_bytes`, 413 above it). Here, in the
# contract, so that a client sizing its batches (`pdgate.batcher`) reads the same number the server enforces.
MAX_BODY_BYTES = 1 << 20


class BatchCreate(HandoffCreate):
    op: Literal["create"] = "create"


class BatchReady(_Model):
    op: Literal["ready"] = "ready"
    transfer_id: Ident
    location: KVLocation


class BatchClaim(ClaimBody):
    op: Literal["claim"] = "claim"
    transfer_id: Ident


class BatchDone(DoneBody):
    op: Literal["done"] = "done"
    transfer_id: Ident


class BatchAbort(AbortBody):
    op: Literal["abort"] = "abort"
    transfer_id: Ident


BatchItem = Annotated[BatchCreate | BatchReady | BatchClaim | BatchDone | BatchAbort, Field(discriminator="op")]


class BatchBody(_Model):
    """Body of `POST /v1/handoffs/batch`: items run in order per transfer id, concurrently across ids."""

    items: list[BatchItem] = Field(..., min_length=1, max_length=MAX_BATCH_ITEMS)


class BatchOutcome(BaseModel):
    """One item's answer: `status` as its single route would answer, with the record or the problem."""

    status: int
    handoff: Handoff | None = None
    problem: Problem | None = None


class BatchResults(BaseModel):
    """Answer of `POST /v1/handoffs/batch` (200 once the envelope is valid): one outcome per item, in order."""

    results: list[BatchOutcome]

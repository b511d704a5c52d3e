"""Everything that crosses from the scheduler half to the workers, and back, as frozen data.

* `PrefillParams` / `DecodeParams`: the typed view of a request's `kv_transfer_params` (the router's
  dict), validated once. vLLM shares that dict with the request; we never write into it, the scheduler
  half keeps its own state.
* `StepMetadata`: the one per-step message from the scheduler half to every worker (wrapped in a vLLM
  `KVConnectorMetadata` by the facade). It is the only path from scheduler to worker.
* `PullOutcome`: what one worker reports about one pull (wrapped in a `KVConnectorWorkerMetadata`,
  which vLLM aggregates over the workers and hands to the scheduler half).

All of it is plain Python (pickled by vLLM between processes); nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.metaserver.models import MAX_KV_KEY, KVLocation, TransportAddress, is_valid_id
from pydantic import ValidationError

__all__ = [
    "DecodeParams",
    "InvalidTransferParams",
    "PrefillParams",
    "PullOutcome",
    "RecvDone",
    "RecvPlan",
    "StepMetadata",
    "address_from_model",
    "address_to_model",
    "prefill_result_params",
]


class InvalidTransferParams(ValueError):
    """`kv_transfer_params` lacks a field we need or carries a wrong type."""

    code = "pd_bad_transfer_params"


def _transfer_id(params: Mapping[str, Any]) -> str:
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not is_valid_id(tid):
        raise InvalidTransferParams(f"kv_transfer_params.transfer_id must be a URL-safe id string, got {tid!r}")
    return tid


def _optional_int(params: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidTransferParams(f"kv_transfer_params.{key} must be an int in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class PrefillParams:
    """What the router sends a prefill: `{"do_remote_decode": true, "transfer_id": ..., "kv_key": ...}`."""

    transfer_id: str
    kv_key: int | None = None  # absent when the router had none; the ledger's answer then supplies it

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> PrefillParams:
        return cls(_transfer_id(params), _optional_int(params, "kv_key", 1, MAX_KV_KEY))


@dataclass(frozen=True)
class DecodeParams:
    """What a decode receives: the prefill's answer (see `prefill_result_params`), forwarded by the router."""

    transfer_id: str
    kv_key: int | None = None
    remote_num_tokens: int | None = None
    remote_block_ids: tuple[int, ...] | None = None
    prefill_instance_id: str | None = None
    # The prefill's own copy of the READY record (`remote_location`), so the pull can start before the
    # claim answers. Unreadable -> None: the decode then waits for the ledger's copy, as before.
    location: KVLocation | None = None

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> DecodeParams:
        tid = _transfer_id(params)
        kv_key = _optional_int(params, "kv_key", 1, MAX_KV_KEY)
        num_tokens = _optional_int(params, "remote_num_tokens", 0, 2**40)
        blocks = params.get("remote_block_ids")
        block_ids: tuple[int, ...] | None = None
        if blocks is not None:
            # Accept the flat list (one KV group) and NIXL's per-group nesting with one group.
            if isinstance(blocks, list) and len(blocks) == 1 and isinstance(blocks[0], list):
                blocks = blocks[0]
            if not isinstance(blocks, list) or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks
            ):
                raise InvalidTransferParams("kv_transfer_params.remote_block_ids must be a list of block ids >= 0")
            block_ids = tuple(blocks)
        pid = params.get("prefill_instance_id")
        if pid is not None and not (isinstance(pid, str) and is_valid_id(pid)):
            raise InvalidTransferParams(f"kv_transfer_params.prefill_instance_id must be an id, got {pid!r}")
        location = None
        raw_location = params.get("remote_location")
        if isinstance(raw_location, Mapping):
            try:
                location = KVLocation.model_validate(raw_location)
            except ValidationError:
                location = None
        return cls(tid, kv_key, num_tokens, block_ids, pid, location)


def prefill_result_params(
    *,
    transfer_id: str,
    kv_key: int | None,
    block_ids: Sequence[int],
    num_tokens: int,
    engine_id: str | None,
    prefill_instance_id: str,
    remote_request_id: str,
    location: KVLocation | None = None,
) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill returns; the router forwards them verbatim to the decode.

    `do_remote_prefill`/`do_remote_decode` keep vLLM's meaning (the scheduler adds
    `remote_prefill_cached_tokens` when `do_remote_prefill` is set). The decode trusts the ledger's
    location over these fields; they are here for the router, logs and `get_num_new_matched_tokens`.
    `remote_location` is the READY record itself: the decode may start pulling from it while its claim
    is in flight, and uses the data only once the claim succeeded and the ledger's record matches it.
    """
    out: dict[str, Any] = {
        "transfer_id": transfer_id,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_num_tokens": num_tokens,
        "remote_request_id": remote_request_id,
        "prefill_instance_id": prefill_instance_id,
    }
    if kv_key is not None:
        out["kv_key"] = kv_key
    if location is not None:
        out["remote_location"] = location.model_dump(mode="json", exclude_none=True)
    return out


@dataclass(frozen=True)
class RecvPlan:
    """Start pulling: every worker reads `sources[its tp rank]` (a transport address) into its blocks."""

    req_id: str
    transfer_id: str
    kv_key: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    sources: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class RecvDone:
    """Report `req_id` as finished receiving; when not `ok`, its `local_block_ids` failed to load."""

    req_id: str
    ok: bool
    local_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepMetadata:
    """One engine step's instructions to the workers."""

    pulls: tuple[RecvPlan, ...] = ()
    recv_done: tuple[RecvDone, ...] = ()
    holds: tuple[str, ...] = ()  # prefill request ids whose blocks are now held for a decode
    frees: tuple[str, ...] = ()  # held prefill request ids to report as finished sending

    def is_empty(self) -> bool:
        return not (self.pulls or self.recv_done or self.holds or self.frees)


@dataclass(frozen=True)
class PullOutcome:
    """One worker's result for one pull."""

    req_id: str
    transfer_id: str
    tp_rank: int
    ok: bool
    code: str | None = None
    message: str | None = None
    nbytes: int = 0
    nblocks: int = 0
    elapsed_s: float = 0.0


# Keys of a transport address that map onto `TransportAddress` fields; the whole dict also travels
# verbatim in `meta`, which is what the pulling transport gets back (`Transport.local_address()`).
_ADDRESS_FIELDS = ("host", "port", "device_id", "device_ip", "cluster_id", "super_device_id", "super_pod_id")


def address_to_model(tp_rank: int, address: Mapping[str, Any]) -> TransportAddress:
    """A worker's `Transport.local_address()` as the contract's `TransportAddress`."""
    fields: dict[str, Any] = {}
    for key in _ADDRESS_FIELDS:
        value = address.get(key)
        if value is None:
            continue
        if key in ("port", "device_id", "cluster_id", "super_device_id"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                continue
        elif not isinstance(value, str):
            value = str(value)
        fields[key] = value
    return TransportAddress(tp_rank=tp_rank, meta=dict(address), **fields)


def address_from_model(address: TransportAddress) -> dict[str, Any]:
    """What the puller hands its transport: the peer's own `local_address()`, kept in `meta`."""
    if address.meta:
        return dict(address.meta)
    return {k: v for k, v in address.model_dump(exclude={"meta", "tp_rank"}).items() if v is not None}

"""Everything that crosses from the scheduler half to the workers, and back, as frozen data.

* `StepMetadata`: the one per-step message from the scheduler half to every worker (wrapped in a vLLM
  `KVConnectorMetadata` by the facade). It is the only path from scheduler to worker.
* `PullOutcome`: what one worker reports about one pull (wrapped in a `KVConnectorWorkerMetadata`,
  which vLLM aggregates over the workers and hands to the scheduler half).
* `address_to_model` / `address_from_model`: a worker's transport address as the contract's
  `TransportAddress`, and back.

A request's `kv_transfer_params` are read and written through `pdgate.contract.KVTransferParams`.
vLLM shares that dict with the request; the connector never writes into it, the scheduler half keeps its
own state. All of it is plain Python (pickled by vLLM between processes); nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdgate.errors import Code
from pdgate.models import TransportAddress

__all__ = ["PullOutcome", "RecvDone", "RecvPlan", "StepMetadata", "address_from_model", "address_to_model"]


@dataclass(frozen=True)
class RecvPlan:
    """Start pulling: every worker reads `sources[its tp rank]` (a transport address) into its blocks.

    `trusted_until` (epoch s) is set when the router claimed the handoff for this decode: a worker whose
    pull finishes before it reports the request finished itself, in that same step (`PullOutcome.reported`),
    without waiting for the scheduler half's `RecvDone` a step later; a failed pull likewise, with its
    blocks as load errors. Past it, the scheduler half confirms with DONE first, as for any late pull.

    `sync`: a synchronous load (vLLM's `load_kv_async=False`, scheduled only under the router's claim on
    an engine with no other request): vLLM computes the request's last prompt token in this very step, so
    the worker blocks in `start_load_kv`, before the forward, until the pull ended. Such a request is
    never reported as finished receiving; a failed or late pull reports its blocks as load errors in the
    same step, and vLLM drops that step's token for the request and fails or recomputes it
    (`kv_load_failure_policy`).
    """

    req_id: str
    transfer_id: str
    kv_key: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    sources: tuple[Mapping[str, Any], ...]
    trusted_until: float | None = None
    sync: bool = False


@dataclass(frozen=True)
class RecvDone:
    """Report `req_id` as finished receiving; when not `ok`, its `local_block_ids` failed to load.

    `ranks`: the TP ranks that must report it (None: all); a rank that reported a trusted pull by itself
    is left out, since vLLM counts one report per rank. `sync`: the request was loaded synchronously
    (`RecvPlan.sync`), so vLLM expects no report: a failure only marks its blocks as load errors."""

    req_id: str
    ok: bool
    local_block_ids: tuple[int, ...] = ()
    ranks: frozenset[int] | None = None
    sync: bool = False


@dataclass(frozen=True)
class StepMetadata:
    """One engine step's instructions to the workers.

    `idle`: no request computes in this step (the engine only steps to poll KV transfers), so a worker may
    block in `get_finished` until a pull in flight ends (`worker.py` says for how long and why).
    """

    pulls: tuple[RecvPlan, ...] = ()
    recv_done: tuple[RecvDone, ...] = ()
    holds: tuple[str, ...] = ()  # prefill request ids whose blocks are now held for a decode
    frees: tuple[str, ...] = ()  # held prefill request ids to report as finished sending
    idle: bool = False

    def is_empty(self) -> bool:
        """Nothing to act on (an idle step with nothing else is still empty)."""
        return not (self.pulls or self.recv_done or self.holds or self.frees)


@dataclass(frozen=True)
class PullOutcome:
    """One worker's result for one pull."""

    req_id: str
    transfer_id: str
    tp_rank: int
    ok: bool
    code: Code | None = None
    message: str | None = None
    nbytes: int = 0
    nblocks: int = 0
    elapsed_s: float = 0.0
    reported: bool = False  # the worker reported the request finished itself (a trusted pull)
    waited_s: float = 0.0  # a synchronous load: how long the worker's step waited for it (submit -> end)
    layer_order: tuple[int, ...] | None = None  # a layer-wise load: the layers the forward waited for, in order


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

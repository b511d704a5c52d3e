"""The prefill/decode contract: the `kv_transfer_params` of a handoff, and (re-exported from
`pdgate.pairing`) the rule of which prefill's KV a decode can take.

The router, the connector and the simulator must agree on both facts, so they are held once: the pairing
rule (`mismatch`, `tp_mismatch`, `source_rank`) in `pdgate.pairing`, the params here.

`kv_transfer_params` (`KVTransferParams`): the dict vLLM carries on a request and returns with a finished
prefill. Each hop has one constructor: the router's request to a prefill (`prefill_request`), the prefill's
answer with the KV it holds (`KVTransferParams(...)` with the `remote_*` fields, `to_dict()`), and the
router's request to a decode (`decode_request` of that answer, then `with_claim` per decode attempt). The
router's are plain functions on dicts because it runs them on every request; what it reads of a prefill's
answer it reads through `KVTransferParams.parse`, like every other reader.

The router's claim (`RouterClaim`, the `claimed_by`/`claim_deadline`/`claim_lease_s` fields): the router
claims the handoff in the ledger for the decode it picked before it sends the request, and says so here.
A decode that finds a claim made for its own instance id, sealed by the router (`claim_seal`, see
`pdgate.claim_seal`: a client cannot forge one), skips its own claim round trip and pulls at
once (`trusted_until`); a pull it saw finish before `trusted_until` read blocks the prefill still held
(the record was CLAIMED for it, so neither expiry nor another decode's DONE could free them). Only the
router writes these fields: `decode_request` drops any the prefill's answer carries, and the router
replaces the client's `kv_transfer_params` whole. Every reader goes through
`KVTransferParams.parse`, which names the field it refuses; keys this contract does not type (vLLM
NIXL's `remote_host`, a simulator's `tp_size`) travel verbatim in `extra`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from pydantic import ValidationError

from pdgate import claim_seal
from pdgate.errors import Code, PDGateError
from pdgate.models import MAX_KV_KEY, KVLocation, is_valid_id
from pdgate.pairing import (
    SUB_BLOCK_TRANSPORTS,
    TALKS_TO,
    TP_GE_TRANSPORTS,
    HeadRead,
    KVFacts,
    KVShape,
    Mismatch,
    head_reads,
    hetero_tp_fits,
    layout_kv_heads,
    mismatch,
    rank_heads,
    source_rank,
    total_kv_heads,
    tp_mismatch,
    transports_talk,
)

__all__ = [
    "SUB_BLOCK_TRANSPORTS",
    "TALKS_TO",
    "TP_GE_TRANSPORTS",
    "HeadRead",
    "InvalidTransferParams",
    "KVFacts",
    "KVShape",
    "KVTransferParams",
    "Mismatch",
    "RouterClaim",
    "decode_request",
    "head_reads",
    "hetero_tp_fits",
    "layout_kv_heads",
    "mismatch",
    "prefill_request",
    "rank_heads",
    "source_rank",
    "total_kv_heads",
    "tp_mismatch",
    "transports_talk",
    "with_claim",
]


class InvalidTransferParams(PDGateError):
    """`kv_transfer_params` carries a field of the wrong type or range; the message names it."""

    code = Code.INVALID_TRANSFER_PARAMS


_TYPED = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "transfer_id",
        "kv_key",
        "metaserver",
        "remote_block_ids",
        "remote_engine_id",
        "remote_num_tokens",
        "remote_prompt_digest",
        "remote_request_id",
        "prefill_instance_id",
        "remote_location",
        "claimed_by",
        "claim_deadline",
        "claim_lease_s",
        "claim_seal",
        "siblings",
    }
)
_ROUTER_KEYS = (
    "claimed_by",
    "claim_deadline",
    "claim_lease_s",
    "claim_seal",
    "siblings",
)  # only the router writes these
_MAX_TOKENS = 2**40
_MAX_EPOCH = 2.0**40
_MAX_SIBLINGS = 1024

BlockIds = tuple[int, ...] | tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class KVTransferParams:
    """The typed `kv_transfer_params`; `to_dict()` is what travels, `parse()` reads it back.

    `do_remote_decode`/`do_remote_prefill` keep vLLM's meaning (a prefill keeps its KV for a remote decode; a
    decode loads its prompt's KV from a remote prefill). `transfer_id` and `kv_key` name the handoff in the
    metaserver's ledger. The `remote_*` fields and `prefill_instance_id` describe the KV a prefill holds:
    `remote_block_ids` is flat or NIXL's per-KV-cache-group nesting, kept in the shape it came in;
    `remote_location` is the prefill's copy of its READY record, a hint a decode may start pulling from
    before its claim answers (`location()` reads it; an unreadable one reads as None and is ignored).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    kv_key: int | None = None
    metaserver: str | None = None
    remote_block_ids: BlockIds | None = None
    remote_engine_id: str | None = None
    remote_num_tokens: int | None = None
    remote_prompt_digest: str | None = None  # of the prompt ids the KV belongs to (`connector.blocks`)
    remote_request_id: str | None = None
    prefill_instance_id: str | None = None
    remote_location: Mapping[str, Any] | None = None
    claimed_by: str | None = None
    claim_deadline: float | None = None
    claim_lease_s: float | None = None
    claim_seal: str | None = None  # the router's HMAC over its claim (`pdgate.claim_seal`)
    siblings: int | None = None  # vLLM's n: the decode requests that share this handoff (one DONE after all)
    extra: Mapping[str, Any] = field(default_factory=dict)  # untyped keys, passed on verbatim

    # -- wire form -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict; fields left None are not written."""
        out: dict[str, Any] = {"do_remote_decode": self.do_remote_decode, "do_remote_prefill": self.do_remote_prefill}
        if self.transfer_id is not None:
            out["transfer_id"] = self.transfer_id
        if self.kv_key is not None:
            out["kv_key"] = self.kv_key
        if self.metaserver is not None:
            out["metaserver"] = self.metaserver
        blocks = self.remote_block_ids
        if blocks is not None:
            out["remote_block_ids"] = [list(g) for g in blocks] if blocks and type(blocks[0]) is tuple else list(blocks)
        if self.remote_engine_id is not None:
            out["remote_engine_id"] = self.remote_engine_id
        if self.remote_num_tokens is not None:
            out["remote_num_tokens"] = self.remote_num_tokens
        if self.remote_prompt_digest is not None:
            out["remote_prompt_digest"] = self.remote_prompt_digest
        if self.remote_request_id is not None:
            out["remote_request_id"] = self.remote_request_id
        if self.prefill_instance_id is not None:
            out["prefill_instance_id"] = self.prefill_instance_id
        if self.remote_location is not None:
            out["remote_location"] = dict(self.remote_location)
        if self.claimed_by is not None:
            out["claimed_by"] = self.claimed_by
        if self.claim_deadline is not None:
            out["claim_deadline"] = self.claim_deadline
        if self.claim_lease_s is not None:
            out["claim_lease_s"] = self.claim_lease_s
        if self.claim_seal is not None:
            out["claim_seal"] = self.claim_seal
        if self.siblings is not None:
            out["siblings"] = self.siblings
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> KVTransferParams:
        """Read a `kv_transfer_params` dict; `InvalidTransferParams` names the first field it refuses.

        Absent and null fields read as not set. Presence rules belong to the reader (`require_transfer_id`,
        `block_ids`): a vLLM prefill answer without a `transfer_id` is still a valid answer to forward.
        """
        if type(params) is not dict and not isinstance(params, Mapping):
            raise InvalidTransferParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
        get = params.get
        location = get("remote_location")
        return cls(
            do_remote_decode=_flag(params, "do_remote_decode"),
            do_remote_prefill=_flag(params, "do_remote_prefill"),
            transfer_id=_id(params, "transfer_id"),
            kv_key=_int(params, "kv_key", 1, MAX_KV_KEY),
            metaserver=_text(params, "metaserver"),
            remote_block_ids=_block_ids(get("remote_block_ids")),
            remote_engine_id=_text(params, "remote_engine_id"),
            remote_num_tokens=_int(params, "remote_num_tokens", 0, _MAX_TOKENS),
            remote_prompt_digest=_text(params, "remote_prompt_digest"),
            remote_request_id=_text(params, "remote_request_id"),
            prefill_instance_id=_id(params, "prefill_instance_id"),
            remote_location=location if type(location) is dict or isinstance(location, Mapping) else None,
            claimed_by=_id(params, "claimed_by"),
            claim_deadline=_float(params, "claim_deadline", 0.0, _MAX_EPOCH),
            claim_lease_s=_float(params, "claim_lease_s", 0.0, 3600.0),
            claim_seal=_text(params, "claim_seal"),
            siblings=_int(params, "siblings", 1, _MAX_SIBLINGS),
            extra={k: v for k, v in params.items() if k not in _TYPED},
        )

    # -- what readers need ---------------------------------------------------------------------------

    def require_transfer_id(self) -> str:
        """The handoff id, which a pdgate prefill and decode cannot work without."""
        if self.transfer_id is None:
            raise InvalidTransferParams("kv_transfer_params.transfer_id is required (a URL-safe id string)")
        return self.transfer_id

    def block_ids(self) -> tuple[int, ...] | None:
        """The prefill's block ids for a single KV cache group (flat, or NIXL's nesting with one group)."""
        blocks = self.remote_block_ids
        if not blocks or not isinstance(blocks[0], tuple):
            return cast("tuple[int, ...] | None", blocks)  # flat (or empty)
        if len(blocks) != 1:
            raise InvalidTransferParams(
                f"kv_transfer_params.remote_block_ids has {len(blocks)} KV cache groups; one is supported"
            )
        return blocks[0]

    def trusted_until(self, instance_id: str, key: bytes | None) -> float | None:
        """When the router claimed this handoff for `instance_id`: the wall-clock time (epoch s) before which
        a finished pull read blocks the prefill still held, half the claim's lease after the ledger
        granted it (the other half is room for clocks that differ). None: no such claim, no key to check
        its seal with, or a seal that does not match (a forged or altered claim): claim yourself."""
        if self.claimed_by != instance_id or self.claim_deadline is None or not self.claim_lease_s:
            return None
        if key is None or self.transfer_id is None:
            return None
        if not claim_seal.seal_matches(
            key,
            self.claim_seal,
            transfer_id=self.transfer_id,
            claimed_by=instance_id,
            deadline=self.claim_deadline,
            lease_s=self.claim_lease_s,
            location=self.remote_location,
        ):
            return None
        return self.claim_deadline - self.claim_lease_s / 2

    def location(self) -> KVLocation | None:
        """The prefill's copy of its READY record, or None when absent or unreadable (it is only a hint)."""
        if self.remote_location is None:
            return None
        try:
            return KVLocation.model_validate(self.remote_location)
        except ValidationError:
            return None


def prefill_request(transfer_id: str, *, kv_key: int | None, metaserver: str | None = None) -> dict[str, Any]:
    """What the router sends a prefill: keep the KV of this request for the handoff `transfer_id`.

    The wire form of `KVTransferParams(do_remote_decode=True, transfer_id=..., kv_key=..., metaserver=...)`,
    written out as a dict because the router builds one per request.
    """
    out: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    if kv_key is not None:
        out["kv_key"] = kv_key
    if metaserver:
        out["metaserver"] = metaserver
    return out


class RouterClaim(NamedTuple):
    """The claim the router made for one decode: who, the lease the ledger granted (its clock), and the
    router's seal over it (`sealed`); an unsealed claim is written but no decode trusts it."""

    decode_instance_id: str
    deadline: float  # epoch s at which the claim lapses
    lease_s: float
    seal: str | None = None

    def sealed(self, key: bytes | None, *, transfer_id: str, location: Mapping[str, Any] | None) -> RouterClaim:
        """This claim with the seal a decode checks; `location` is the `remote_location` the decode will
        get (the prefill's answer, verbatim). Without a key (no admin token) it stays unsealed."""
        if key is None:
            return self
        return self._replace(
            seal=claim_seal.seal(
                key,
                transfer_id=transfer_id,
                claimed_by=self.decode_instance_id,
                deadline=self.deadline,
                lease_s=self.lease_s,
                location=location,
            )
        )


def decode_request(
    answer: Mapping[str, Any], transfer_id: str, *, kv_key: int | None, metaserver: str | None = None
) -> dict[str, Any]:
    """The prefill's answer as the router forwards it to a decode, the one definition of that hop.

    Everything the prefill said travels verbatim (a vLLM NIXL prefill's keys included) but a claim, which
    only the router grants (`with_claim`); the router's handoff id wins, and so does the router's
    `metaserver` when it has one: a prefill naming another ledger would send the decode to claim from (and
    pull where) that ledger says. The prefill's `kv_key` wins (the router refuses an answer whose `kv_key`
    is not the handoff's), and its `metaserver` is kept only where the router has none. Done on the dict
    the router already checked with `parse`, so that keys this contract does not type travel as they came;
    the decode parses them again, naming any field it refuses.
    """
    out = dict(answer)
    for key in _ROUTER_KEYS:
        out.pop(key, None)
    out["do_remote_prefill"] = True
    out["do_remote_decode"] = False
    out["transfer_id"] = transfer_id
    if out.get("kv_key") is None and kv_key is not None:
        out["kv_key"] = kv_key
    if metaserver:
        out["metaserver"] = metaserver
    return out


def with_claim(params: Mapping[str, Any], claim: RouterClaim | None, *, siblings: int = 1) -> dict[str, Any]:
    """`decode_request`'s params for one decode attempt: with the router's claim for that decode, or
    without any claim (the decode then claims through the metaserver itself). `siblings`: the request's
    `n`, when above 1: vLLM's decode fans it into that many requests sharing this one handoff."""
    out = dict(params)
    for key in _ROUTER_KEYS:
        out.pop(key, None)
    if claim is not None:
        out["claimed_by"] = claim.decode_instance_id
        out["claim_deadline"] = claim.deadline
        out["claim_lease_s"] = claim.lease_s
        if claim.seal is not None:
            out["claim_seal"] = claim.seal
    if siblings > 1:
        out["siblings"] = siblings
    return out


def _bad(key: str, expected: str, value: Any) -> InvalidTransferParams:
    return InvalidTransferParams(f"kv_transfer_params.{key} must be {expected}, got {value!r}", field=key)


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None or value is False:
        return False
    if value is not True:
        raise _bad(key, "true or false", value)
    return True


def _id(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not str or not is_valid_id(value):
        raise _bad(key, "a URL-safe id string (letters, digits, . _ : -; at most 128 characters)", value)
    return value


def _text(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not str and not isinstance(value, str):
        raise _bad(key, "a string", value)
    return value


def _int(params: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:  # bool is an int subclass: refused too
        raise _bad(key, f"an int in [{lo}, {hi}]", value)
    return value


def _float(params: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not lo <= value <= hi:  # bool refused: its type is neither
        raise _bad(key, f"a number in [{lo:g}, {hi:g}]", value)
    return float(value)


def _block_ids(value: Any) -> BlockIds | None:
    if value is None:
        return None
    if type(value) is list and value and type(value[0]) is list:
        return tuple(_flat_ids(g, value) for g in value)
    return _flat_ids(value, value)


def _flat_ids(ids: Any, whole: Any) -> tuple[int, ...]:
    if type(ids) is not list:
        raise _bad("remote_block_ids", "a list of block ids >= 0 (or one such list per KV cache group)", whole)
    if ids and not (all(type(b) is int for b in ids) and min(ids) >= 0):  # bool is refused: its type is not int
        raise _bad("remote_block_ids", "a list of block ids >= 0 (or one such list per KV cache group)", whole)
    return tuple(ids)

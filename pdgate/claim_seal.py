"""The seal on the router's claim: proof, for a decode, that the router (not a client) granted it.

Why: a decode that finds a claim for itself in `kv_transfer_params` (`contract.KVTransferParams.trusted_until`)
pulls from the location the params name and uses the KV without asking the ledger. vLLM's API is open to
whoever can reach the decode, so without proof a client could write `claimed_by` itself, point
`remote_location` at another request's blocks and read that request's KV (its prompt) back as tokens. The
ledger is the authority; the seal lets the router vouch for one ledger answer for the length of its lease.

The seal is an HMAC-SHA256 over what the decode trusts without the ledger: the handoff id, the decode it was
claimed for, the claim's deadline and lease, and the location it will pull from. The key is derived from the
metaserver's admin token, the one secret the router (which claims with it) and every connector (which
writes READY and DONE with it) already hold (`pdgate.auth.derive_key`). Where no token is configured
(protected mode, loopback only) nothing is sealed and nothing is trusted: the decode claims itself, which
renews the router's claim (same claimant) at the cost of one ledger round trip.

A seal does not stop a replay of the same claim within its lease by someone who saw it on the wire; such an
observer already sees the tokens. It stops forgery, and a changed location or decode.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import orjson

from pdgate.auth import derive_key

__all__ = ["PURPOSE", "claim_key", "seal", "seal_matches"]

PURPOSE = "pdgate router claim v1"
SEAL_HEX_LEN = 64


def claim_key(admin_token: str | None) -> bytes | None:
    """The sealing key both sides derive from the metaserver's admin token; None without one."""
    return derive_key(admin_token, PURPOSE) if admin_token else None


def _message(
    transfer_id: str, claimed_by: str, deadline: float, lease_s: float, location: Mapping[str, Any] | None
) -> bytes:
    # orjson writes floats in their shortest round-tripping form and sorts keys, so the router (which holds
    # the prefill's answer as orjson parsed it) and the decode (as vLLM's JSON parser read it) agree.
    return orjson.dumps([transfer_id, claimed_by, deadline, lease_s, location], option=orjson.OPT_SORT_KEYS)


def seal(
    key: bytes,
    *,
    transfer_id: str,
    claimed_by: str,
    deadline: float,
    lease_s: float,
    location: Mapping[str, Any] | None,
) -> str:
    """The hex seal the router writes as `claim_seal` beside its claim."""
    return hmac.new(key, _message(transfer_id, claimed_by, deadline, lease_s, location), hashlib.sha256).hexdigest()


def seal_matches(
    key: bytes,
    given: str | None,
    *,
    transfer_id: str,
    claimed_by: str,
    deadline: float,
    lease_s: float,
    location: Mapping[str, Any] | None,
) -> bool:
    """Whether `given` seals exactly these fields under `key` (compared in constant time)."""
    if given is None or len(given) != SEAL_HEX_LEN:
        return False
    try:
        expected = seal(
            key, transfer_id=transfer_id, claimed_by=claimed_by, deadline=deadline, lease_s=lease_s, location=location
        )
    except (TypeError, orjson.JSONEncodeError):  # a location orjson cannot write is not one the router sealed
        return False
    return hmac.compare_digest(expected.encode(), given.encode())

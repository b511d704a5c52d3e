"""The router's claim seal (`pdgate.claim_seal`) and the decode's trust in a claim
(`KVTransferParams.trusted_until`): only a claim the router sealed, unchanged, for this decode, is trusted."""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
import pytest

from pdgate import claim_seal
from pdgate.auth import derive_key
from pdgate.contract import KVTransferParams, RouterClaim, decode_request, with_claim

KEY = claim_seal.claim_key("the-admin-token")
LOCATION: dict[str, Any] = {
    "instance_id": "p-1",
    "block_ids": [4, 5, 6],
    "address": {"kind": "nixl", "agent_name": "p-1-a", "regions": [{"base_ptr": 140000000000, "block_len": 4096}]},
    "lease_s": 30.0,
}


def _decode_params(claim: RouterClaim | None, *, location: dict[str, Any] | None = LOCATION) -> KVTransferParams:
    """What the decode parses: the prefill's answer through the router, over JSON as vLLM reads it."""
    answer = {"do_remote_decode": True, "remote_block_ids": [4, 5, 6], "kv_key": 77}
    if location is not None:
        answer["remote_location"] = location
    params = with_claim(decode_request(answer, "t-1", kv_key=77), claim)
    return KVTransferParams.parse(json.loads(orjson.dumps(params)))


def _claim(key: bytes | None = KEY, *, for_: str = "d-1", location: dict[str, Any] | None = LOCATION) -> RouterClaim:
    deadline = time.time() + 10.123456789
    return RouterClaim(for_, deadline, 10.0).sealed(key, transfer_id="t-1", location=location)


def test_a_sealed_claim_for_this_decode_is_trusted() -> None:
    params = _decode_params(_claim())
    until = params.trusted_until("d-1", KEY)
    assert until is not None and params.claim_deadline is not None
    assert until == pytest.approx(params.claim_deadline - 5.0)


def test_a_claim_a_client_wrote_itself_is_not_trusted() -> None:
    forged = with_claim(decode_request({"remote_location": LOCATION}, "t-1", kv_key=77), None)
    forged.update(claimed_by="d-1", claim_deadline=time.time() + 10, claim_lease_s=10.0, claim_seal="0" * 64)
    assert KVTransferParams.parse(forged).trusted_until("d-1", KEY) is None
    del forged["claim_seal"]
    assert KVTransferParams.parse(forged).trusted_until("d-1", KEY) is None


@pytest.mark.parametrize(
    "change",
    [
        {"remote_location": {**LOCATION, "block_ids": [1, 2, 3]}},  # another request's blocks
        {"transfer_id": "t-2"},
        {"claim_deadline": 2.0**39},  # a longer claim than the ledger granted
        {"claim_lease_s": 600.0},
        {"remote_location": None},
    ],
)
def test_a_sealed_claim_with_any_trusted_field_changed_is_not_trusted(change: dict[str, Any]) -> None:
    params = _decode_params(_claim()).to_dict()
    params.update(change)
    assert KVTransferParams.parse(params).trusted_until("d-1", KEY) is None


def test_a_claim_for_another_decode_or_under_another_key_is_not_trusted() -> None:
    params = _decode_params(_claim(for_="d-2"))
    assert params.trusted_until("d-1", KEY) is None
    assert params.trusted_until("d-2", KEY) is not None
    assert params.trusted_until("d-2", claim_seal.claim_key("another-token")) is None


def test_without_a_key_nothing_is_sealed_or_trusted() -> None:
    assert claim_seal.claim_key(None) is None and claim_seal.claim_key("") is None
    unsealed = _decode_params(_claim(None))
    assert unsealed.claimed_by == "d-1" and unsealed.claim_seal is None  # the ledger claim is still named
    assert unsealed.trusted_until("d-1", KEY) is None
    assert _decode_params(_claim()).trusted_until("d-1", None) is None


def test_the_prefill_cannot_pass_a_seal_through() -> None:
    answer = {"remote_location": LOCATION, "claimed_by": "d-1", "claim_seal": "a" * 64, "claim_deadline": 1e9}
    assert not {"claimed_by", "claim_seal", "claim_deadline"} & set(decode_request(answer, "t-1", kv_key=1))


def test_a_seal_of_the_wrong_shape_is_refused_without_raising() -> None:
    for given in (None, "", "zz", "a" * 63, "é" * 64):
        assert not claim_seal.seal_matches(
            KEY, given, transfer_id="t", claimed_by="d", deadline=1.0, lease_s=1.0, location=None
        )
    assert not claim_seal.seal_matches(
        KEY, "a" * 64, transfer_id="t", claimed_by="d", deadline=1.0, lease_s=1.0, location={"x": {1, 2}}
    )


def test_the_key_is_derived_per_purpose_and_never_the_token_itself() -> None:
    assert KEY == derive_key("the-admin-token", claim_seal.PURPOSE)
    assert KEY != b"the-admin-token" and KEY != derive_key("the-admin-token", "another purpose")

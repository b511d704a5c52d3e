"""pdgate.contract.KVTransferParams: one constructor per hop, one parser that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from pdgate.claim_seal import claim_key
from pdgate.contract import (
    InvalidTransferParams,
    KVTransferParams,
    RouterClaim,
    decode_request,
    prefill_request,
    with_claim,
)
from pdgate.errors import Code, PDGateError
from pdgate.models import KVLocation


def test_the_prefill_request_is_the_wire_form_of_the_typed_params() -> None:
    wire = prefill_request("pd-1", kv_key=42, metaserver="http://meta:1")
    assert wire == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "pd-1",
        "kv_key": 42,
        "metaserver": "http://meta:1",
    }
    typed = KVTransferParams(do_remote_decode=True, transfer_id="pd-1", kv_key=42, metaserver="http://meta:1")
    assert KVTransferParams.parse(wire) == typed and typed.to_dict() == wire
    assert "metaserver" not in prefill_request("t", kv_key=1, metaserver=None)


def test_the_prefill_answer_round_trips() -> None:
    loc = KVLocation(block_ids=[[3, 4]], num_tokens=40, tp_size=1)
    answer = KVTransferParams(
        do_remote_prefill=True,
        transfer_id="t-9",
        kv_key=42,
        remote_block_ids=(3, 4),
        remote_engine_id="e0",
        remote_num_tokens=40,
        remote_prompt_digest="0f" * 16,
        remote_request_id="cmpl-x-0-abcd",
        prefill_instance_id="p0",
        remote_location=loc.model_dump(mode="json", exclude_none=True),
    )
    wire = answer.to_dict()
    assert wire["remote_block_ids"] == [3, 4] and wire["do_remote_decode"] is False
    back = KVTransferParams.parse(wire)
    assert back == answer
    assert back.block_ids() == (3, 4) and back.location() == loc


def test_the_decode_request_keeps_what_the_prefill_said() -> None:
    from_p = {
        "do_remote_prefill": True,
        "remote_engine_id": "p1",
        "remote_block_ids": [[1, 2]],
        "kv_key": 9,
        "remote_host": "10.0.0.5",  # vLLM NIXL's own keys travel untouched
        "tp_size": 2,
    }
    out = decode_request(from_p, "pd-1", kv_key=42, metaserver="http://meta:1")
    assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
    assert out["transfer_id"] == "pd-1"
    assert out["kv_key"] == 9  # the prefill's own value wins
    assert out["remote_block_ids"] == [[1, 2]] and out["metaserver"] == "http://meta:1"
    assert (out["remote_host"], out["tp_size"]) == ("10.0.0.5", 2)
    # A prefill naming another ledger does not get to send the decode there: the router's wins.
    hostile = decode_request({**from_p, "metaserver": "http://evil:1"}, "pd-1", kv_key=9, metaserver="http://meta:1")
    assert hostile["metaserver"] == "http://meta:1"
    assert decode_request({"metaserver": "http://m:2"}, "t", kv_key=5)["metaserver"] == "http://m:2"  # none of ours
    no_key = decode_request({"kv_key": None}, "t", kv_key=5, metaserver=None)
    assert no_key["kv_key"] == 5 and "metaserver" not in no_key
    assert from_p == {  # the prefill's answer itself is left as it was
        "do_remote_prefill": True,
        "remote_engine_id": "p1",
        "remote_block_ids": [[1, 2]],
        "kv_key": 9,
        "remote_host": "10.0.0.5",
        "tp_size": 2,
    }
    assert KVTransferParams.parse(out).block_ids() == (1, 2)  # and the decode reads it


def test_only_the_router_grants_a_claim() -> None:
    """A claim in the prefill's answer (or anything upstream of it) never reaches the decode; the router's
    claim for one decode attempt does, and the next attempt's replaces or removes it."""
    forged = {"do_remote_prefill": True, "claimed_by": "d1", "claim_deadline": 9e9, "claim_lease_s": 9e3, "siblings": 4}
    base = decode_request(forged, "pd-1", kv_key=3)
    assert not {"claimed_by", "claim_deadline", "claim_lease_s", "siblings"} & set(base)
    key = claim_key("admin-token")
    assert KVTransferParams.parse(base).trusted_until("d1", key) is None
    claimed = with_claim(base, RouterClaim("d1", 1000.0, 10.0).sealed(key, transfer_id="pd-1", location=None))
    kv = KVTransferParams.parse(claimed)
    assert (kv.claimed_by, kv.claim_deadline, kv.claim_lease_s) == ("d1", 1000.0, 10.0)
    assert kv.to_dict() == claimed
    assert kv.trusted_until("d1", key) == 995.0  # half the lease after the ledger granted it
    assert kv.trusted_until("d2", key) is None  # a claim made for another decode is not this one's
    assert with_claim(claimed, None) == base and "claimed_by" not in base
    fanned = with_claim(base, None, siblings=3)
    assert KVTransferParams.parse(fanned).siblings == 3 and "siblings" not in with_claim(fanned, None)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"transfer_id": ""}, "transfer_id"),
        ({"claim_seal": 5}, "claim_seal"),
        ({"claim_seal": ["a" * 64]}, "claim_seal"),
        ({"transfer_id": "has space"}, "transfer_id"),
        ({"transfer_id": 5}, "transfer_id"),
        ({"kv_key": 0}, "kv_key"),
        ({"kv_key": True}, "kv_key"),
        ({"kv_key": "7"}, "kv_key"),
        ({"remote_block_ids": [1, -1]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": [[1], [2, "x"]]}, "remote_block_ids"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
        ({"prefill_instance_id": "a b"}, "prefill_instance_id"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"remote_engine_id": 3}, "remote_engine_id"),
        ({"remote_prompt_digest": ["ab"]}, "remote_prompt_digest"),
        ({"claimed_by": "d 1"}, "claimed_by"),
        ({"claim_deadline": "soon"}, "claim_deadline"),
        ({"claim_deadline": float("nan")}, "claim_deadline"),
        ({"claim_lease_s": True}, "claim_lease_s"),
        ({"claim_lease_s": -1.0}, "claim_lease_s"),
        ({"siblings": 0}, "siblings"),
    ],
)
def test_the_parser_names_the_field_it_refuses(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidTransferParams) as info:
        KVTransferParams.parse(params)
    err = info.value
    assert isinstance(err, PDGateError) and err.code is Code.INVALID_TRANSFER_PARAMS
    assert f"kv_transfer_params.{field} " in err.message and err.context["field"] == field


def test_presence_is_the_readers_rule() -> None:
    bare = KVTransferParams.parse({"do_remote_prefill": True})
    with pytest.raises(InvalidTransferParams, match="transfer_id is required"):
        bare.require_transfer_id()
    assert bare.block_ids() is None and bare.location() is None
    with pytest.raises(InvalidTransferParams, match="2 KV cache groups"):
        KVTransferParams.parse({"remote_block_ids": [[1], [2]]}).block_ids()


def test_an_unreadable_location_is_only_ignored() -> None:
    params = KVTransferParams.parse({"transfer_id": "t", "remote_location": {"block_ids": "nope"}})
    assert params.location() is None
    assert KVTransferParams.parse({"transfer_id": "t", "remote_location": "nope"}).remote_location is None

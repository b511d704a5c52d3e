"""DP-rank routing and compatibility refusal, with simulators that advertise their shapes."""

from __future__ import annotations

import openai
import pytest

from tests.integration.router.conftest import HTTP, Deployment, transfer_ids


def test_dp_ranks_are_routed_and_loaded_separately() -> None:
    with Deployment(prefill_policy="round_robin") as d:
        p, dec = d.add_many([("prefill", ("--dp-size", "2")), ("decode", ())])
        ranks = [f"{p.id}.dp0", f"{p.id}.dp1"]
        d.wait_available(*ranks, dec.id)
        c = d.openai()
        for i in range(4):
            c.completions.create(model="sim-model", prompt=f"dp {i}", max_tokens=2)
        assert p.stats()["by_rank"] == [2, 2]
        for entry in p.stats(log=True)["log"]:
            h = HTTP.get(f"{d.url}/v1/handoffs/{entry['transfer_id']}").json()
            assert h["prefill_instance_id"] == ranks[entry["dp_rank"]] and h["state"] == "DONE"
        assert dec.count("claimed") == 4 and dec.count("mismatches") == 0
        listed = {i["id"]: i["dp_rank"] for i in HTTP.get(d.url + "/v1/instances").json()["instances"]}
        assert listed[ranks[0]] == 0 and listed[ranks[1]] == 1


def test_incompatible_pairs_are_refused_with_the_reason() -> None:
    with Deployment(on_ledger_outage="refuse") as d:  # not served whole (router/whole.py): the refusal
        p, dec = d.add_many([("prefill", ("--block-size", "16")), ("decode", ("--block-size", "32"))])
        d.wait_available(p.id, dec.id, available=True)
        with pytest.raises(openai.APIStatusError) as info:
            d.openai().completions.create(model="sim-model", prompt="x", max_tokens=1)
        assert info.value.status_code == 503 and info.value.code == "pd_no_compatible_pair"
        assert "has block_size 32, prefill #" in info.value.message and "has 16" in info.value.message
        assert dec.id not in info.value.message and p.id not in info.value.message  # opaque names only
        h = d.health()
        assert h["status"] == "unavailable" and "block_size 32" in h["reason"]
        assert d.openai().models.list().data == []
        assert p.count("requests") == 0 and dec.count("requests") == 0
        [ok] = d.add_many([("decode", ("--block-size", "16"))])
        d.wait_available(ok.id)
        d.openai().completions.create(model="sim-model", prompt="x", max_tokens=1)
        assert transfer_ids(ok, "decode") and dec.count("requests") == 0


def test_tp_mismatch_needs_replicated_kv() -> None:
    with Deployment(on_ledger_outage="refuse") as d:
        p, dec = d.add_many([("prefill", ("--tp-size", "4")), ("decode", ("--tp-size", "2"))])
        d.wait_available(p.id, dec.id)
        with pytest.raises(openai.APIStatusError) as info:
            d.openai().completions.create(model="sim-model", prompt="x", max_tokens=1)
        assert "tp 2" in info.value.message and "not replicated" in info.value.message
        [mla] = d.add_many([("prefill", ("--tp-size", "4", "--kv-replicated"))])
        d.wait_available(mla.id)
        d.openai().completions.create(model="sim-model", prompt="x", max_tokens=1)
        assert mla.count("prefill") == 1 and p.count("requests") == 0

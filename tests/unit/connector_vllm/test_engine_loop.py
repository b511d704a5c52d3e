"""Both halves together, for real, minus the model: two in-process "engines" (prefill and decode).

Each engine is vLLM's own `Scheduler` with `PDGateConnector` (loaded through `kv_connector_module_path`)
plus one `PDGateConnector` in the WORKER role over real CPU KV tensors with the real NIXL transport, all
talking to a real metaserver over HTTP. The test plays the model runner: it drives the worker connector
through the same hook sequence as vLLM's `KVConnectorModelRunnerMixin` and writes recognisable bytes into
the prefill's KV blocks where a forward pass would. So a decode that finishes here finished because its
blocks really arrived through NIXL, and the prefill's blocks were freed because the ledger said DONE.
The harness is `engine_support.py`; the loads under the router's claim are in `test_engine_router_claim.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.request import RequestStatus

from pdgate.models import HandoffState
from tests.fakes import fake_llmdatadist
from tests.support.servers import UvicornThread
from tests.unit.connector_vllm.conftest import BLOCK_SIZE, LAYERS, make_request
from tests.unit.connector_vllm.engine_support import (
    Engine,
    meta,
    new_handoff,
    prefill,
    registered,
    run_until,
    state,
)


def test_both_engines_register_with_their_worker_addresses(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    p, d = engines
    for engine, role in ((p, "prefill"), (d, "decode")):
        run_until(lambda e=engine: registered(metaserver.url, e.instance_id) is not None, [], what="registration")
        inst = registered(metaserver.url, engine.instance_id)
        assert inst is not None and inst.role.value == role
        assert (inst.block_size, inst.tp_size, inst.transport.value, inst.model) == (BLOCK_SIZE, 1, "nixl", inst.model)
        (addr,) = inst.transport_addresses
        assert addr.tp_rank == 0 and addr.meta["kind"] == "nixl" and addr.meta["agent_metadata"]
        assert inst.kv_layout.endswith("/L2/H2/D32/B32")


def test_one_prefill_one_decode_over_nixl(engines: tuple[Engine, Engine], metaserver: UvicornThread) -> None:
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)

    params = prefill(p, url, tid, kv_key, prompt_len=70)
    assert params["transfer_id"] == tid and params["kv_key"] == kv_key and params["remote_num_tokens"] == 70
    p_blocks = p.block_ids("p1")
    assert params["remote_block_ids"] == p_blocks and len(p_blocks) == 3
    assert "p1" in p.sched.requests  # held for the decode
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")

    # The decode request carries what the router forwards: P's answer.
    d.sched.add_request(make_request("d1", 70, params, max_tokens=4))
    d.step()
    req = d.sched.requests["d1"]
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 70
    d_blocks = d.block_ids("d1")
    run_until(lambda: "d1" in d.outputs, [p, d], what="decode")
    for name in LAYERS:
        assert torch.equal(d.kv[name][d_blocks], p.kv[name][p_blocks])  # the prefill's bytes, via NIXL
    assert state(url, tid) is HandoffState.DONE
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")

    run_until(
        lambda: d.counters().get("recv_ok") == 1 and p.counters().get("sends_freed_done") == 1, [p, d], what="stats"
    )
    dc, pc = d.counters(), p.counters()
    assert (dc["tokens_loaded"], dc["blocks_pulled"], dc["recv_failed"]) == (70, 3, 0)
    assert (pc["sends_held"], pc["ready_recorded"]) == (1, 1)


def test_one_prefill_one_decode_over_llmdatadist_without_a_rank_table(
    model_dir: Path, metaserver: UvicornThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker finds its NPU's address itself (here: the prefill from its config, the decode from
    $PDGATE_DEVICE_IP), registers it, and the decode links to the prefill's llm_datadist cluster with the
    address the handoff's location carries. llm_datadist is the fake (tests/fakes), under its import name."""
    fake_llmdatadist.reset()
    monkeypatch.setitem(sys.modules, "llm_datadist", fake_llmdatadist)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    # The metaserver's URL and token come from the environment, as they do in the engine containers.
    monkeypatch.setenv("PDGATE_CONNECTOR_METASERVER_URL", metaserver.url)
    monkeypatch.setenv("PDGATE_CONNECTOR_METASERVER_TOKEN", "unused-by-this-metaserver")
    monkeypatch.setenv("PDGATE_DEVICE_IP", "192.168.200.7")
    common: dict[str, Any] = {"transport": "llmdatadist", "hccn_conf": str(tmp_path / "absent-hccn.conf")}
    p = Engine(
        model_dir,
        None,
        "kv_producer",
        tmp_path,
        **common,
        device_ips=["192.168.100.7"],
        transport_options={"listen_port": 26007},
    )
    d = Engine(model_dir, None, "kv_consumer", tmp_path, **common, transport_options={})
    try:
        url = metaserver.url
        run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
        inst = registered(url, p.instance_id)
        assert inst is not None and inst.transport.value == "llmdatadist"
        (addr,) = inst.transport_addresses
        assert (addr.device_id, addr.device_ip, addr.cluster_id) == (0, "192.168.100.7", 0xC0A86407)
        assert addr.meta["listen_port"] == 26007

        tid, kv_key = new_handoff(url, p.instance_id)
        params = prefill(p, url, tid, kv_key, prompt_len=50)
        p_blocks = p.block_ids("p1")
        run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
        d.sched.add_request(make_request("d1", 50, params, max_tokens=3))
        d.step()
        d_blocks = d.block_ids("d1")
        run_until(lambda: "d1" in d.outputs, [p, d], what="decode")
        for name in LAYERS:
            assert torch.equal(d.kv[name][d_blocks], p.kv[name][p_blocks])  # via llm_datadist pull_blocks
        assert state(url, tid) is HandoffState.DONE
        assert ("link_clusters", 0xC0A8C807, (0xC0A86407,)) in fake_llmdatadist.WORLD.calls
        run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
        run_until(lambda: d.counters().get("recv_ok") == 1, [p, d], what="stats")
        assert d.counters()["tokens_loaded"] == 50
    finally:
        p.close()
        d.close()
        fake_llmdatadist.reset()


def test_decode_of_an_aborted_handoff_reports_load_errors_and_recomputes(
    model_dir: Path, metaserver: UvicornThread, tmp_path: Path
) -> None:
    p = Engine(model_dir, metaserver.url, "kv_producer", tmp_path)
    d = Engine(model_dir, metaserver.url, "kv_consumer", tmp_path, policy="recompute")
    try:
        url = metaserver.url
        run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="registration")
        tid, kv_key = new_handoff(url, p.instance_id)
        params = prefill(p, url, tid, kv_key, prompt_len=40)
        meta(url, lambda c: c.abort(tid, "client went away"))
        run_until(lambda: "p1" not in p.sched.requests, [p], what="prefill freed on ABORTED")

        d.sched.add_request(make_request("d1", 40, params, max_tokens=2))
        d.step()
        assert d.sched.requests["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        computed: list[int] = []

        def recomputed() -> bool:
            so = d.step()
            computed.append(so.num_scheduled_tokens.get("d1", 0))
            return "d1" in d.outputs

        run_until(recomputed, [], what="recompute")
        # The whole prompt was computed locally (no garbage decoded from blocks that never arrived).
        assert 40 in computed
        run_until(lambda: d.counters().get("recv_failed") == 1, [d], what="stats")
        assert d.counters()["claims_failed"] == 1 and d.counters()["invalid_blocks"] == 2
        # The prefill's stats file is written by its own control thread (coalesced): wait for it too.
        run_until(lambda: p.counters().get("sends_freed_aborted") == 1, [p], what="prefill stats")
    finally:
        p.close()
        d.close()


def test_unclaimed_handoff_expires_and_the_prefill_frees(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    p, _ = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p], what="registration")
    tid, kv_key = new_handoff(url, p.instance_id, lease_s=0.5)
    prefill(p, url, tid, kv_key, prompt_len=33)
    assert "p1" in p.sched.requests
    run_until(lambda: "p1" not in p.sched.requests, [p], what="free on EXPIRED")
    assert state(url, tid) is HandoffState.EXPIRED
    run_until(lambda: p.counters().get("sends_freed_expired") == 1, [p], what="stats")


def test_decode_aborted_before_scheduling_frees_theprefill(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p], what="registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = prefill(p, url, tid, kv_key, prompt_len=40)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    d.sched.add_request(make_request("d1", 40, params))
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # before any schedule()
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill freed")
    assert state(url, tid) is HandoffState.ABORTED

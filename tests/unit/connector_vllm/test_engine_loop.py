"""Both halves together, for real, minus the model: two in-process "engines" (prefill and decode).

Each engine is vLLM's own `Scheduler` with `PDGateConnector` (loaded through `kv_connector_module_path`)
plus one `PDGateConnector` in the WORKER role over real CPU KV tensors with the real NIXL transport, all
talking to a real metaserver over HTTP. The test plays the model runner: it drives the worker connector
through the same hook sequence as vLLM's `KVConnectorModelRunnerMixin` and writes recognisable bytes into
the prefill's KV blocks where a forward pass would. So a decode that finishes here finished because its
blocks really arrived through NIXL, and the prefill's blocks were freed because the ledger said DONE.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from pdgate.connector import worker
from pdgate.connector.connector import PDGateConnector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from pdgate.claim_seal import claim_key
from pdgate.contract import RouterClaim, with_claim
from pdgate.meta_client import MetaClient
from pdgate.models import HandoffCreate, HandoffState, Instance
from tests.fakes import fake_llmdatadist
from tests.support.meta import uid
from tests.support.servers import UvicornThread
from tests.unit.connector_vllm.conftest import (
    BLOCK_SIZE,
    HEAD_SIZE,
    LAYERS,
    NUM_KV_HEADS,
    kv_cache_config,
    make_request,
    make_scheduler,
    vllm_config,
)

T = TypeVar("T")
NUM_BLOCKS = 128


def meta(url: str, fn: Callable[[MetaClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with MetaClient(url) as client:
            return await fn(client)

    return asyncio.run(run())


TOKEN = "engine-loop-token"


class Engine:
    """A vLLM scheduler + one worker connector, stepped by hand like EngineCore's busy loop."""

    def __init__(self, model_dir: Path, metaserver_url: str | None, kv_role: str, tmp: Path, **extra: Any) -> None:
        """`metaserver_url=None` leaves the key out (the connector then reads $PDGATE_CONNECTOR_METASERVER_URL)."""
        self.role = "decode" if kv_role == "kv_consumer" else "prefill"
        self.instance_id = uid(kv_role.removeprefix("kv_"))
        self.stats_file = tmp / f"{self.instance_id}.json"
        if metaserver_url is not None:
            extra["metaserver_url"] = metaserver_url
        cfg = vllm_config(
            model_dir,
            kv_role=kv_role,
            num_blocks=NUM_BLOCKS,
            kv_load_failure_policy=extra.pop("policy", "fail"),
            extra={
                "url": f"http://127.0.0.1:{18000 + len(self.instance_id)}",
                "instance_id": self.instance_id,
                "stats_file": str(self.stats_file),
                "transport_options": {"ucx_net_devices": "lo"},
                "feed_wait_s": 1.0,
                "heartbeat_s": 1.0,
                **extra,
            },
        )
        self.sched = make_scheduler(cfg, NUM_BLOCKS)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config(NUM_BLOCKS))
        assert isinstance(self.worker, PDGateConnector) and isinstance(self.sched.connector, PDGateConnector)
        shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
        self.kv = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        # What EngineCore does after KV init: worker handshake metadata -> scheduler-side connector.
        hs = self.worker.get_handshake_metadata()
        self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): hs})
        self.outputs: dict[str, Any] = {}
        self.steps = 0
        self.finished_recving: dict[str, int] = {}  # req id -> the step whose worker reported it
        self.outcome_steps: dict[str, int] = {}  # req id -> the step whose worker output carried its pull's outcome

    def step(self) -> SchedulerOutput:
        self.steps += 1
        so = self.sched.schedule()
        w = self.worker
        # The worker side of one step, in KVConnectorModelRunnerMixin's order.
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        for rid in recving or ():
            self.finished_recving.setdefault(rid, self.steps)
        meta = kv_out.kv_connector_worker_meta
        for oc in getattr(meta, "outcomes", None) or ():
            self.outcome_steps.setdefault(oc.req_id, self.steps)
        # The "forward": prefill tokens write KV, the last one samples a token.
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            self._write_kv(rid)
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done_prefill else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        for eco in self.sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                self.outputs[out.request_id] = out
        return so

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def _write_kv(self, req_id: str) -> None:
        if self.role == "decode":
            return
        for i, block in enumerate(self.block_ids(req_id)):
            for j, name in enumerate(LAYERS):
                self.kv[name][block].fill_(float(1 + i + 10 * j))

    def counters(self) -> dict[str, int]:
        return json.loads(self.stats_file.read_text())["counters"] if self.stats_file.exists() else {}

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def run_until(
    cond: Callable[[], bool], engines: list[Engine], *, timeout: float = 20.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout}s")
        for e in engines:
            e.step()
        time.sleep(0.001)


@pytest.fixture
def engines(
    model_dir: Path, metaserver: UvicornThread, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine]]:
    # The admin token is what the router's claim is sealed with (pdgate.claim_seal); this
    # metaserver has none configured and takes any caller on loopback. An indirect parameter adds
    # connector settings for the decode.
    decode_extra: dict[str, Any] = getattr(request, "param", {})
    p = Engine(model_dir, metaserver.url, "kv_producer", tmp_path, metaserver_token=TOKEN)
    d = Engine(model_dir, metaserver.url, "kv_consumer", tmp_path, metaserver_token=TOKEN, **decode_extra)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def registered(url: str, instance_id: str) -> Instance | None:
    async def get(c: MetaClient) -> Instance | None:
        return next((i for i in await c.list_instances() if i.id == instance_id), None)

    return meta(url, get)


def new_handoff(url: str, prefill_id: str, lease_s: float | None = None) -> tuple[str, int]:
    h = meta(url, lambda c: c.create_handoff(HandoffCreate(prefill_instance_id=prefill_id, lease_s=lease_s)))
    return h.transfer_id, h.kv_key


def state(url: str, tid: str) -> HandoffState:
    return meta(url, lambda c: c.get_handoff(tid)).state


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


def _prefill(p: Engine, url: str, tid: str, kv_key: int, prompt_len: int, rid: str = "p1") -> dict[str, Any]:
    p.sched.add_request(
        make_request(rid, prompt_len, {"do_remote_decode": True, "transfer_id": tid, "kv_key": kv_key}, max_tokens=1)
    )
    run_until(lambda: rid in p.outputs, [p], what="prefill")
    out = p.outputs[rid]
    assert out.finish_reason is not None and out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def test_one_prefill_one_decode_over_nixl(engines: tuple[Engine, Engine], metaserver: UvicornThread) -> None:
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)

    params = _prefill(p, url, tid, kv_key, prompt_len=70)
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


def _first_forward(d: Engine, rid: str, timeout: float = 20.0) -> int:
    """Step the decode engine until `rid` is scheduled to compute; that step's number."""
    deadline = time.monotonic() + timeout
    while True:
        so = d.step()
        if rid in so.num_scheduled_tokens:
            return d.steps
        assert time.monotonic() < deadline, f"{rid} was never scheduled"
        time.sleep(0.001)


def _routers_claim(url: str, p: Engine, d: Engine) -> tuple[str, dict[str, Any]]:
    """A prefill's answer with the claim the router adds for decode `d` (prompt of 70 tokens)."""
    tid, kv_key = new_handoff(url, p.instance_id)
    params = _prefill(p, url, tid, kv_key, prompt_len=70)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    h = meta(url, lambda c: c.claim(tid, d.instance_id))
    assert h.deadline is not None
    claim = RouterClaim(d.instance_id, h.deadline, h.deadline - h.updated_at)
    return tid, with_claim(params, claim.sealed(claim_key(TOKEN), transfer_id=tid, location=params["remote_location"]))


def test_an_idle_decode_under_the_routers_claim_pulls_in_the_step_that_computes_its_first_token(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """vLLM's own scheduler with the synchronous load (the decode has no other request): the step that
    allocates the request's blocks also computes its last prompt token; the worker pulled in
    `start_load_kv`, before that forward, so the blocks hold the prefill's bytes by then; vLLM gets no
    finished-receiving report for it; DONE is recorded afterwards and the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, claimed = _routers_claim(url, p, d)
    p_blocks = p.block_ids("p1")
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    so = d.step()
    assert so.num_scheduled_tokens == {"d1": 1}  # the first forward, in the allocation step
    assert d.sched.requests["d1"].num_computed_tokens == 70
    d_blocks = d.block_ids("d1")
    for name in LAYERS:
        assert torch.equal(d.kv[name][d_blocks], p.kv[name][p_blocks])  # landed before that forward
    assert "d1" in d.outputs and d.outputs["d1"].new_token_ids == [7]  # its first token, from that step
    run_until(lambda: "d1" in d.outputs and d.outputs["d1"].finish_reason is not None, [p, d], what="decode")
    assert "d1" not in d.finished_recving  # vLLM expects no report of a synchronous load
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE, off the path")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 1, [p, d], what="stats")
    dc = d.counters()
    assert (dc["recv_sync"], dc["claims_by_router"], dc["claims_failed"], dc["invalid_blocks"]) == (1, 1, 0, 0)
    assert dc["tokens_loaded"] == 69  # the decode computed the last prompt token itself


def test_a_synchronous_load_that_fails_fails_the_request_in_its_step(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """The prefill's blocks cannot be read (the router sealed a location with a block the prefill does not
    have): the worker marks the blocks as load errors in the very step, vLLM drops that step's token and,
    under the `fail` policy, ends the request with an error; the handoff is aborted so the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = _prefill(p, url, tid, kv_key, prompt_len=70)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    bad = dict(params)
    bad["remote_location"] = dict(params["remote_location"])
    bad["remote_location"]["block_ids"] = [[NUM_BLOCKS + 5] * len(params["remote_location"]["block_ids"][0])]
    h = meta(url, lambda c: c.claim(tid, d.instance_id))
    assert h.deadline is not None
    claim = RouterClaim(d.instance_id, h.deadline, h.deadline - h.updated_at)
    claimed = with_claim(bad, claim.sealed(claim_key(TOKEN), transfer_id=tid, location=bad["remote_location"]))
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    so = d.step()
    assert so.num_scheduled_tokens == {"d1": 1}
    out = d.outputs["d1"]
    assert out.finish_reason is not None and out.new_token_ids == []  # failed, nothing sampled reaches it
    run_until(lambda: state(url, tid) is HandoffState.ABORTED, [p, d], what="the handoff aborted")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_failed") == 1, [p, d], what="stats")
    assert d.counters()["recv_sync"] == 1


@pytest.mark.parametrize("engines", [{"sync_load_when_idle": False}], indirect=True)
def test_under_the_routers_claim_the_first_forward_follows_the_pull_by_one_step(
    engines: tuple[Engine, Engine], metaserver: UvicornThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asynchronous load (the synchronous one switched off, as when the decode has other requests):
    what the router does (claims for the decode it picked, passes the claim in kv_transfer_params),
    then vLLM's own scheduler: the decode sends no claim, the worker reports the pull finished in the
    step that started it (a step that computes nothing waits for its pull), and the request's first
    forward is the very next step (no step through the scheduler half). DONE is recorded afterwards, and
    the prefill frees."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, claimed = _routers_claim(url, p, d)

    # The decode computes nothing else, so the step that starts the pull waits for it (worker.py); the
    # bound is set long so that the pull's end (a first NIXL contact here), not a timer, ends the wait.
    monkeypatch.setattr(worker, "_IDLE_WAIT_S", 60.0)
    d.sched.add_request(make_request("d1", 70, claimed, max_tokens=4))
    allocated = d.steps + 1
    first = _first_forward(d, "d1")
    assert d.finished_recving["d1"] == d.outcome_steps["d1"] == allocated  # reported in the step that pulled
    assert first == allocated + 1  # and computed in the next one
    run_until(lambda: "d1" in d.outputs, [p, d], what="decode")
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE, off the path")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 1, [p, d], what="stats")
    dc = d.counters()
    assert (dc["claims_by_router"], dc["claims_failed"], dc["done_refused"], dc["tokens_loaded"]) == (1, 0, 0, 70)


def test_siblings_of_one_handoff_each_load_the_prefills_blocks_and_done_follows_the_last(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    """vLLM's n > 1: the decode gets one child request per sample, all with the same kv_transfer_params
    (what vLLM's parallel sampling does with the router's request). Both read the prefill's bytes over
    NIXL into their own blocks under one claim; the ledger says DONE once, and the prefill frees then."""
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p, d], what="prefill registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = _prefill(p, url, tid, kv_key, prompt_len=70)
    p_blocks = p.block_ids("p1")
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    h = meta(url, lambda c: c.claim(tid, d.instance_id))
    assert h.deadline is not None
    claim = RouterClaim(d.instance_id, h.deadline, h.deadline - h.updated_at)
    sealed = claim.sealed(claim_key(TOKEN), transfer_id=tid, location=params["remote_location"])
    shared = with_claim(params, sealed, siblings=2)
    for i in range(2):
        d.sched.add_request(make_request(f"{i}_d1", 70, shared, max_tokens=3))
    d.step()
    blocks = {rid: d.block_ids(rid) for rid in ("0_d1", "1_d1")}
    assert set(blocks["0_d1"]).isdisjoint(blocks["1_d1"])
    run_until(lambda: {"0_d1", "1_d1"} <= set(d.outputs), [p, d], what="both siblings decoded")
    for rid, mine in blocks.items():
        for name in LAYERS:
            assert torch.equal(d.kv[name][mine], p.kv[name][p_blocks]), rid
    run_until(lambda: state(url, tid) is HandoffState.DONE, [p, d], what="DONE after the last sibling")
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill blocks freed")
    run_until(lambda: d.counters().get("recv_ok") == 2, [p, d], what="stats")
    assert (d.counters()["recv_failed"], d.counters()["done_refused"]) == (0, 0)


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
        params = _prefill(p, url, tid, kv_key, prompt_len=50)
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
        params = _prefill(p, url, tid, kv_key, prompt_len=40)
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
    _prefill(p, url, tid, kv_key, prompt_len=33)
    assert "p1" in p.sched.requests
    run_until(lambda: "p1" not in p.sched.requests, [p], what="free on EXPIRED")
    assert state(url, tid) is HandoffState.EXPIRED
    run_until(lambda: p.counters().get("sends_freed_expired") == 1, [p], what="stats")


def test_decode_aborted_before_scheduling_frees_the_prefill(
    engines: tuple[Engine, Engine], metaserver: UvicornThread
) -> None:
    p, d = engines
    url = metaserver.url
    run_until(lambda: registered(url, p.instance_id) is not None, [p], what="registration")
    tid, kv_key = new_handoff(url, p.instance_id)
    params = _prefill(p, url, tid, kv_key, prompt_len=40)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    d.sched.add_request(make_request("d1", 40, params))
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # before any schedule()
    run_until(lambda: "p1" not in p.sched.requests, [p, d], what="prefill freed")
    assert state(url, tid) is HandoffState.ABORTED

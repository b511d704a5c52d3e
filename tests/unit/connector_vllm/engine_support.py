"""The engine loop's harness: two in-process "engines" (vLLM's own `Scheduler` with `PDGateConnector`, plus
one worker `PDGateConnector` over real CPU KV tensors), stepped by hand like EngineCore's busy loop, and
the metaserver calls the tests make (`test_engine_loop.py` says what they prove). The `engines` fixture
(a prefill and a decode) is in `conftest.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from pdgate.connector.connector import PDGateConnector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from pdgate.claim_seal import claim_key
from pdgate.contract import RouterClaim, with_claim
from pdgate.meta_client import MetaClient
from pdgate.models import HandoffCreate, HandoffState, Instance
from tests.support.meta import uid
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


def registered(url: str, instance_id: str) -> Instance | None:
    async def get(c: MetaClient) -> Instance | None:
        return next((i for i in await c.list_instances() if i.id == instance_id), None)

    return meta(url, get)


def new_handoff(url: str, prefill_id: str, lease_s: float | None = None) -> tuple[str, int]:
    h = meta(url, lambda c: c.create_handoff(HandoffCreate(prefill_instance_id=prefill_id, lease_s=lease_s)))
    return h.transfer_id, h.kv_key


def state(url: str, tid: str) -> HandoffState:
    return meta(url, lambda c: c.get_handoff(tid)).state


def prefill(p: Engine, url: str, tid: str, kv_key: int, prompt_len: int, rid: str = "p1") -> dict[str, Any]:
    """Run a prefill of `prompt_len` tokens for handoff `tid` on `p`; its answer's kv_transfer_params."""
    p.sched.add_request(
        make_request(rid, prompt_len, {"do_remote_decode": True, "transfer_id": tid, "kv_key": kv_key}, max_tokens=1)
    )
    run_until(lambda: rid in p.outputs, [p], what="prefill")
    out = p.outputs[rid]
    assert out.finish_reason is not None and out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def first_forward(d: Engine, rid: str, timeout: float = 20.0) -> int:
    """Step the decode engine until `rid` is scheduled to compute; that step's number."""
    deadline = time.monotonic() + timeout
    while True:
        so = d.step()
        if rid in so.num_scheduled_tokens:
            return d.steps
        assert time.monotonic() < deadline, f"{rid} was never scheduled"
        time.sleep(0.001)


def routers_claim(url: str, p: Engine, d: Engine) -> tuple[str, dict[str, Any]]:
    """A prefill's answer with the claim the router adds for decode `d` (prompt of 70 tokens)."""
    tid, kv_key = new_handoff(url, p.instance_id)
    params = prefill(p, url, tid, kv_key, prompt_len=70)
    run_until(lambda: state(url, tid) is HandoffState.READY, [p], what="READY")
    return tid, claimed_for(url, d, tid, params)


def claimed_for(url: str, d: Engine, tid: str, params: dict[str, Any], *, siblings: int = 1) -> dict[str, Any]:
    """`params` with the claim the router makes in the ledger for decode `d`, sealed as the router seals it
    (over the `remote_location` the params carry)."""
    h = meta(url, lambda c: c.claim(tid, d.instance_id))
    assert h.deadline is not None
    claim = RouterClaim(d.instance_id, h.deadline, h.deadline - h.updated_at)
    sealed = claim.sealed(claim_key(TOKEN), transfer_id=tid, location=params["remote_location"])
    return with_claim(params, sealed, siblings=siblings)

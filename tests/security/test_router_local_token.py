"""`pdgate-local` protects its metaserver: a fresh admin token per stack, handed to the router and the
engines through their environment, never on a command line (issue 9, "Writes need a credential")."""

from __future__ import annotations

from pathlib import Path

from pdgate.deploy.local.stack import LocalStack, StackConfig, router_args
from pdgate.deploy.local.vllm_instance import VllmInstanceSpec


def test_each_stack_generates_a_strong_token_and_passes_it_by_environment(tmp_path: Path) -> None:
    cfg = StackConfig(run_dir=tmp_path, model_dir=tmp_path / "model")
    one, two = LocalStack(cfg, log=lambda _: None), LocalStack(cfg, log=lambda _: None)
    token = one.admin_token
    assert token != two.admin_token and len(token) >= 32  # 32 url-safe chars: > 190 random bits

    assert one.router_env()["PDGATE_ROUTER_ADMIN_TOKEN"] == token
    assert all(token not in arg for arg in router_args(cfg))

    spec = VllmInstanceSpec(name="prefill-0", port=18100, cpu="0")
    env = one.engine_env(spec, cfg.flags())
    assert env["PDGATE_CONNECTOR_METASERVER_TOKEN"] == token
    assert all(token not in arg for arg in spec.argv(Path("/usr/bin/python3"), cfg.flags()))

"""`pdgate doctor` reads what an engine runs with from vLLM's own /metrics (`vllm:cache_config_info`) and
names a registration that says otherwise (a static or hand-written one: its pairs would be wrong)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cli.conftest import TOKEN, metaserver, pdgate
from tests.support.servers import UvicornThread

# What vLLM 0.1x's /metrics holds for its cache config (an info gauge), trimmed to the labels read.
VLLM_METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",cache_dtype="fp8",engine="0",gpu_memory_utilization="0.9"} 1.0\n'
)


async def vllm_like(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An engine answering /health and vLLM's /metrics, over a real socket."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = VLLM_METRICS.encode() if scope["path"] == "/metrics" else b"{}"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def engine() -> Iterator[UvicornThread]:
    with UvicornThread(vllm_like) as server:
        yield server


def _register(meta_url: str, engine_url: str, name: str, **fields: Any) -> None:
    body = {"id": name, "role": "decode", "url": engine_url, "model": "m", "transport": "sim", **fields}
    resp = httpx.post(meta_url + "/v1/instances", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text


def test_a_registration_that_disagrees_with_vllm_is_named(
    engine: UvicornThread, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = metaserver()
    try:
        _register(meta.url, engine.url, "wrong-one", block_size=16, kv_dtype="bfloat16")
        _register(meta.url, engine.url, "right-one", block_size=32, kv_dtype="fp8")
        code, out, _ = pdgate(capsys, "doctor", "--metaserver", meta.url, "--token", TOKEN, "--json")
    finally:
        meta.stop()
    found = [f for f in json.loads(out) if f["check"] == "config"]
    assert code == 1
    assert sorted(f["status"] for f in found) == ["fail", "ok"]
    [bad] = [f for f in found if f["status"] == "fail"]
    assert bad["message"].startswith("wrong-one: block_size 16 registered, 32 in vLLM; kv_dtype bfloat16")
    [good] = [f for f in found if f["status"] == "ok"]
    assert good["message"].startswith("right-one")


def test_engines_without_vllms_metrics_are_skipped(stack: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = pdgate(capsys, "doctor", "--router", stack.url, "--token", TOKEN, "--json")
    assert [f["status"] for f in json.loads(out) if f["check"] == "config"] == ["skip"]

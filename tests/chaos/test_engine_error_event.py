"""An engine that fails a request mid-stream must reach the client as a typed pdgate error.

Found by tests/e2e/test_08_faults.py: when a decode vLLM cannot load the KV (here: the pull from the
prefill timed out), vLLM ends the 200 stream with its own error event
(`data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}`)
and `data: [DONE]`. The router relays streams without parsing them and only checks the `[DONE]`, so the
client gets an error with no pdgate code: an untyped failure in the chaos suite's terms.

Real sockets and processes: a real pdgate-router process, a real pdgate-sim prefill, and a decode that
answers exactly what vLLM sends in that case (served by uvicorn over a real socket), read by the
official `openai` client. The router turns that event into `pd_decode_failed` (`streaming.relay_stream`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.support.ports import free_port
from tests.support.servers import UvicornThread

pytestmark = pytest.mark.chaos

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from chaos_stack import BIN, Procs, wait_ready  # noqa: E402

_HEAD = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "sim-model"}
# What vLLM's completion server yields when generation fails after the stream started.
_VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def failing_decode(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/v1/completions":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        token = {**_HEAD, "choices": [{"index": 0, "text": " a", "finish_reason": None}]}
        for part in (_event(token), _event(_VLLM_ERROR), b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scope["path"] == "/v1/models":
        body = orjson.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model", "max_model_len": 4096}]})
    else:
        body = b'{"status": "ok"}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def router_url() -> Iterator[str]:
    procs = Procs()
    decode = UvicornThread(failing_decode).start()
    try:
        sim_port, port = free_port(), free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        sim = procs.start("sim", [str(BIN / "pdgate-sim"), "--role", "prefill", "--port", str(sim_port)])
        wait_ready(sim_url, proc=sim)
        argv = [str(BIN / "pdgate-router"), "--port", str(port), "--prefill", sim_url, "--decode", decode.url]
        argv += ["--model", "sim-model", "--log-level", "warning"]
        router = procs.start("router", argv)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=router)
        yield url
    finally:
        procs.close()
        decode.stop()


def test_engine_error_event_mid_stream_reaches_the_client_typed(router_url: str) -> None:
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.APIError) as info:
        for _ in client.completions.create(model="sim-model", prompt="hello there", max_tokens=4, stream=True):
            pass
    body = info.value.body if isinstance(info.value.body, dict) else {}
    assert str(body.get("code", "")).startswith("pd_"), body

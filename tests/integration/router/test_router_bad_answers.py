"""Engines that misbehave on the wire, over real sockets: never an empty or truncated 200, a typed error for a
stream that is not SSE, and any failure while talking to one instance is that instance's failure.

Each fake engine is a tiny threaded HTTP server whose completions answer is scripted byte by byte
(`Engine`); the router in front of it is real (`Deployment`, static instances). A bad decode next to a
good one must cost the client nothing (the router retries while nothing has been sent); a bad decode
alone must give a typed 502, never a 200.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from pdgate.urls import static_instance_id
from tests.integration.router.conftest import Deployment

MODEL = "m"
ANSWER = orjson.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " fine", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
SSE_EVENT = (
    b'data: {"id":"c","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":" ok"}]}\n\n'
)

Script = Callable[[dict[str, Any]], bytes]  # request body -> the raw bytes sent back, then the socket closes


def head(status: str, *headers: str) -> bytes:
    return ("HTTP/1.1 " + status + "\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def whole(body: bytes, ctype: str = "application/json") -> bytes:
    return head("200 OK", f"content-type: {ctype}", f"content-length: {len(body)}", "connection: close") + body


def good_prefill(req: dict[str, Any]) -> bytes:
    """Answers with the KV it holds, after recording READY in the router's ledger, as a real prefill does
    (the router then claims the handoff for its decode)."""
    asked = req["kv_transfer_params"]
    location = {"block_ids": [[1, 2]], "num_tokens": 2}
    httpx.put(f"{asked['metaserver']}/v1/handoffs/{asked['transfer_id']}/ready", json=location).raise_for_status()
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p",
        "remote_block_ids": [[1, 2]],
        "transfer_id": req["kv_transfer_params"]["transfer_id"],
    }
    return whole(orjson.dumps({**orjson.loads(ANSWER), "kv_transfer_params": kv}))


def good_decode(req: dict[str, Any]) -> bytes:
    if req.get("stream"):
        body = SSE_EVENT + b"data: [DONE]\n\n"
        return head("200 OK", "content-type: text/event-stream", f"content-length: {len(body)}") + body
    return whole(ANSWER)


# -- the misbehaviours -------------------------------------------------------------------------------

BAD_JSON_ANSWERS: dict[str, Script] = {
    "empty body": lambda req: head("200 OK", "content-type: application/json", "content-length: 0"),
    "closes before its declared length": lambda req: (
        head("200 OK", "content-type: application/json", f"content-length: {len(ANSWER)}") + ANSWER[: len(ANSWER) // 2]
    ),
    "closes half-way through a body that ends with the connection": lambda req: (
        head("200 OK", "content-type: application/json", "connection: close") + ANSWER[: len(ANSWER) // 2]
    ),
    "closes before the end of its chunks": lambda req: (
        head("200 OK", "content-type: application/json", "transfer-encoding: chunked")
        + b"%x\r\n%s\r\n" % (len(ANSWER) // 2, ANSWER[: len(ANSWER) // 2])
    ),
    "a body that is not JSON": lambda req: whole(b"<html>oops</html>"),
}


def json_to_a_stream(req: dict[str, Any]) -> bytes:
    return whole(ANSWER) if req.get("stream") else good_decode(req)


VLLM_ERROR = (
    b'data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}\n\n'
)


def sse(*events: bytes) -> bytes:
    body = b"".join(events)
    return head("200 OK", "content-type: text/event-stream", f"content-length: {len(body)}") + body


def error_mid_stream(req: dict[str, Any]) -> bytes:
    """What vLLM sends when generation fails after the stream started: its own error event, then [DONE]."""
    return sse(SSE_EVENT, VLLM_ERROR, b"data: [DONE]\n\n") if req.get("stream") else good_decode(req)


def error_before_a_token(req: dict[str, Any]) -> bytes:
    return sse(VLLM_ERROR, b"data: [DONE]\n\n") if req.get("stream") else good_decode(req)


def deep_kv_params(req: dict[str, Any]) -> bytes:
    """Valid JSON whose kv_transfer_params nest deeper than the router can re-encode for the decode (orjson
    reads 1024 levels but writes 254)."""
    kv = {"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": req["kv_transfer_params"]["transfer_id"]}
    params = orjson.dumps(kv)[:-1] + b',"x":' + b"[" * 300 + b"1" + b"]" * 300 + b"}"
    return whole(orjson.dumps(orjson.loads(ANSWER))[:-1] + b',"kv_transfer_params":' + params + b"}")


class Engine:
    """A fake engine on a real socket: /health and /v1/models answer normally, completions run `script`."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.completions = 0
        engine = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    engine.serve(self.rfile, self.connection)
                except OSError:
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, rfile: Any, conn: socket.socket) -> None:
        request_line = rfile.readline().decode("latin-1")
        if not request_line:  # a connection closed before sending a request (a connect that timed out)
            return
        length = 0
        while (line := rfile.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = rfile.read(length) if length else b""
        path = request_line.split(" ")[1] if " " in request_line else "/"
        if path == "/health":
            out = whole(b"{}")
        elif path == "/v1/models":
            out = whole(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        else:
            self.completions += 1
            out = self.script(orjson.loads(body))
        conn.sendall(out)
        conn.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines() -> Iterator[Callable[[Script], Engine]]:
    made: list[Engine] = []

    def make(script: Script) -> Engine:
        made.append(Engine(script))
        return made[-1]

    yield make
    for e in made:
        e.stop()


def router(prefill: list[Engine], decode: list[Engine], **settings: Any) -> Deployment:
    defaults: dict[str, Any] = {
        "prefill_policy": "round_robin",
        "decode_policy": "round_robin",
        "breaker_failures": 1000,
        "whole_on_failure": False,  # the PD path's own typed errors (router/whole.py serves them whole)
        "max_resumes": 0,
    }
    return Deployment(
        prefill=[e.url for e in prefill], decode=[e.url for e in decode], model=MODEL, **{**defaults, **settings}
    )


def post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **body}, timeout=10
    )


@pytest.mark.parametrize("how", list(BAD_JSON_ANSWERS))
def test_a_bad_json_answer_never_reaches_the_client_as_a_200(engines: Callable[[Script], Engine], how: str) -> None:
    bad = engines(BAD_JSON_ANSWERS[how])
    with router([engines(good_prefill)], [bad], breaker_failures=3) as r:
        for _ in range(3):
            resp = post(r.url)
            assert resp.status_code == 502, (how, resp.status_code, resp.content)
            assert resp.headers["x-pdgate-error"] == "pd_decode_failed"
            assert resp.json()["error"]["code"] == "pd_decode_failed"
        breakers = {i["id"]: i["breaker"] for i in r.health()["instances"]}
        assert breakers[static_instance_id(bad.url)] == "open"  # each bad answer counted against the decode


@pytest.mark.parametrize("how", list(BAD_JSON_ANSWERS))
def test_a_bad_json_answer_is_retried_on_another_decode(engines: Callable[[Script], Engine], how: str) -> None:
    bad, good = engines(BAD_JSON_ANSWERS[how]), engines(good_decode)
    with router([engines(good_prefill)], [bad, good]) as r:
        client = r.openai()
        for _ in range(4):  # round robin: every other request starts on the bad decode
            out = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert out.choices[0].text == " fine"
    assert bad.completions >= 2 and good.completions == 4


def test_a_stream_answered_with_json_is_a_typed_error_and_retried(engines: Callable[[Script], Engine]) -> None:
    bad = engines(json_to_a_stream)
    with router([engines(good_prefill)], [bad]) as r:
        resp = post(r.url, stream=True)
        assert resp.status_code == 502 and resp.headers["x-pdgate-error"] == "pd_decode_failed"
        assert "not SSE" in resp.json()["error"]["message"]
    good = engines(good_decode)
    with router([engines(good_prefill)], [bad, good]) as r:
        for _ in range(2):
            stream = r.openai().completions.create(model=MODEL, prompt="x", max_tokens=1, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == " ok"


def test_an_engine_error_event_mid_stream_reaches_the_client_typed(engines: Callable[[Script], Engine]) -> None:
    with router([engines(good_prefill)], [engines(error_mid_stream)]) as r:
        got: list[str] = []
        with pytest.raises(openai.APIError) as info:
            for chunk in r.openai().completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True):
                got.append(chunk.choices[0].text)
    assert got == [" ok"] and info.value.code == "pd_decode_failed"
    assert "failed the request mid-stream" in info.value.message
    assert "Internal server error" not in info.value.message  # the engine's own words go to the log only


def test_an_engine_error_event_before_any_token_is_retried(engines: Callable[[Script], Engine]) -> None:
    bad, good = engines(error_before_a_token), engines(good_decode)
    with router([engines(good_prefill)], [bad, good]) as r:
        for _ in range(2):
            stream = r.openai().completions.create(model=MODEL, prompt="x", max_tokens=1, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == " ok"
    assert bad.completions == 1 and good.completions == 2


def test_any_failure_handling_one_prefills_answer_is_that_prefills_failure(
    engines: Callable[[Script], Engine],
) -> None:
    """An answer the router chokes on (here: params nested deeper than it can re-encode) is the prefill's
    failure, retried on another prefill, never a 500 `router_error`."""
    bad = engines(deep_kv_params)
    with router([bad], [engines(good_decode)]) as r:
        resp = post(r.url)
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "pd_prefill_failed"
    with router([bad, engines(good_prefill)], [engines(good_decode)]) as r:
        for _ in range(2):
            assert r.openai().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == " fine"
    assert bad.completions >= 2


def test_the_openai_client_sees_a_typed_error_not_a_half_answer(engines: Callable[[Script], Engine]) -> None:
    bad = engines(BAD_JSON_ANSWERS["closes half-way through a body that ends with the connection"])
    with router([engines(good_prefill)], [bad]) as r, pytest.raises(openai.InternalServerError) as info:
        r.openai().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert info.value.code == "pd_decode_failed"

"""The processes `bench/router.py` starts from source (`python -c`): the canned engines and metaserver of
its isolated mode, and a proxy written like vLLM's toy_proxy_server.py. Kept apart so that the benchmark
reads as the measurement, and these read as what is measured against."""

from __future__ import annotations

__all__ = ["CANNED", "READ_BODY", "TOY_PROXY"]

# What every raw ASGI server here starts with: the lifespan protocol answered, else the request body read whole.
READ_BODY = """
async def read_body(scope, receive, send):
    if scope["type"] != "http":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup": await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown": await send({"type": "lifespan.shutdown.complete"}); return None
    body, more = b"", True
    while more:
        m = await receive(); body += m.get("body", b""); more = m.get("more_body", False)
    return body
"""

# Canned engines and metaserver in one raw ASGI process: isolates the router's own cost.
CANNED = (
    READ_BODY
    + r"""
import sys, time, orjson
port = int(sys.argv[1]); url = f"http://127.0.0.1:{port}"
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1", "remote_block_ids": [[1, 2, 3]],
      "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "cmpl-x-0", "tp_size": 1}
HEAD = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "sim-model"}
P_ANS = orjson.dumps({**HEAD, "choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
                      "kv_transfer_params": KV})
CHUNK = b"data: " + orjson.dumps({**HEAD, "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}) + b"\n\n"
def d_ans(n):
    return orjson.dumps({**HEAD, "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n}})
def inst(i, role):
    return {"id": i, "role": role, "url": url, "model": "sim-model", "lease_s": 10, "registered_at": 0,
            "last_heartbeat": time.time() + 1e6}
INSTANCES = orjson.dumps({"instances": [inst("p1", "prefill"), inst("d1", "decode")]})
# As vLLM and pdgate-sim answer: without a card the router looks for one on every request (model_cards).
MODELS = orjson.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model", "created": 0,
                                                   "owned_by": "canned", "max_model_len": 4096}]})
async def app(scope, receive, send):
    body = await read_body(scope, receive, send)
    if body is None:
        return
    path, status, out = scope["path"], 200, b"{}"
    if path == "/v1/handoffs":
        status = 201
        out = orjson.dumps({"transfer_id": orjson.loads(body)["transfer_id"], "kv_key": 7, "state": "PENDING",
                            "prefill_instance_id": "p1", "created_at": 0.0, "updated_at": 0.0, "lease_s": 60.0})
    elif path == "/v1/handoffs/batch":  # the router's creates, batched (--metaserver-batches)
        out = b'{"results":[' + b",".join(b'{"status":201,"handoff":%s}' % orjson.dumps(
            {"transfer_id": i["transfer_id"], "kv_key": 7, "state": "PENDING", "prefill_instance_id": "p1",
             "created_at": 0.0, "updated_at": 0.0, "lease_s": 60.0}) for i in orjson.loads(body)["items"]) + b"]}"
    elif path == "/v1/instances":
        out = INSTANCES
    elif path == "/v1/models":
        out = MODELS
    elif path == "/v1/completions":
        b = orjson.loads(body)
        if (b.get("kv_transfer_params") or {}).get("do_remote_decode"):  # a whole request has none
            out = P_ANS
        elif b.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(b["max_tokens"]):
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        else:
            out = d_ans(b["max_tokens"])
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})
import uvicorn
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""
)

TOY_PROXY = """
import itertools, sys, uuid, httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
P, D = sys.argv[2].split(","), sys.argv[3].split(",")
app = FastAPI()
pc, dc = itertools.cycle(httpx.AsyncClient(base_url=u, timeout=None) for u in P), itertools.cycle(
    httpx.AsyncClient(base_url=u, timeout=None) for u in D)
@app.post("/v1/completions")
async def completions(request: Request):
    req = await request.json()
    rid = str(uuid.uuid4())
    p = dict(req, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    p.pop("stream_options", None)
    r = await next(pc).post("/v1/completions", json=p, headers={"X-Request-Id": rid})
    r.raise_for_status()
    req["kv_transfer_params"] = r.json().get("kv_transfer_params")
    client = next(dc)
    async def gen():
        async with client.stream("POST", "/v1/completions", json=req, headers={"X-Request-Id": rid}) as resp:
            async for chunk in resp.aiter_bytes():
                yield chunk
    return StreamingResponse(gen(), media_type="application/json")
import uvicorn
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

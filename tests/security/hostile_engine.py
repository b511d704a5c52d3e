"""FAKE engines for the security tests: neither vLLM nor pdgate-sim, but tiny scripted HTTP servers on real
sockets (`tests.integration.router.test_router_bad_answers.Engine`) that answer as a pdgate prefill or decode
does, and can be told to lie. The simulator cannot produce a hostile answer; these can.

`prefill(token, lie)` records READY in the router's embedded ledger (with the admin token), as a real
prefill does, then answers the completion, with `return_token_ids` the prompt's and the first token's ids;
`lie` edits the answer first. `Decode` answers every request (an SSE stream or a JSON answer) and keeps
the bodies it was sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson

from tests.integration.router.test_router_bad_answers import Script, head, whole

__all__ = ["FIRST_ID", "LOCATION", "MODEL", "Decode", "Lie", "prefill"]

MODEL = "m"  # what the fake engines' /v1/models serve
LOCATION = {"block_ids": [[1, 2]], "num_tokens": 2}  # the READY record a fake prefill writes to the ledger
FIRST_ID = 1000  # the id of the first token a fake prefill samples

Lie = Callable[[dict[str, Any]], None]  # edits a prefill's answer before it is sent


def prefill(token: str | None, lie: Lie | None = None) -> Script:
    """A prefill's script: READY in the ledger, then its answer (edited by `lie`)."""

    def script(req: dict[str, Any]) -> bytes:
        asked = req["kv_transfer_params"]
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"{asked['metaserver']}/v1/handoffs/{asked['transfer_id']}/ready"
        httpx.put(url, json=LOCATION, headers=auth, timeout=5).raise_for_status()
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "p",
            "remote_block_ids": [[1, 2]],
            "remote_num_tokens": 2,
            "transfer_id": asked["transfer_id"],
            "kv_key": asked["kv_key"],
            "remote_location": dict(LOCATION),
        }
        choice: dict[str, Any] = {"index": 0, "text": " fine", "finish_reason": "length", "logprobs": None}
        if req.get("return_token_ids"):
            prompt = req["prompt"]
            choice["prompt_token_ids"] = prompt if isinstance(prompt, list) else [ord(c) for c in prompt]
            choice["token_ids"] = [FIRST_ID]
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "kv_transfer_params": kv,
        }
        if lie is not None:
            lie(answer)
        return whole(orjson.dumps(answer))

    return script


class Decode:
    """A decode's script that keeps every body it was sent: ' ok' as a stream or a JSON answer."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, req: dict[str, Any]) -> bytes:
        self.bodies.append(req)
        if req.get("stream"):
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL}
            chunk["choices"] = [{"index": 0, "text": " ok", "finish_reason": "length"}]
            body = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
            return head("200 OK", "content-type: text/event-stream", f"content-length: {len(body)}") + body
        answer = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL}
        answer["choices"] = [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}]
        answer["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return whole(orjson.dumps(answer))

"""A decode that answers garbage, or its engine's error event, after its first byte: the stream goes on
elsewhere (router/resume.py), over real sockets with the openai client and fake engines scripted byte by
byte (test_router_bad_answers.Engine). What the rest is asked with is checked on the wire: the prompt's
ids and the ids the client got, the tokens left, no KV params; and the client never sees the router's
own `return_token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.integration.router.conftest import Deployment
from tests.integration.router.test_router_bad_answers import (  # noqa: F401 (engines: the fixture)
    MODEL,
    VLLM_ERROR,
    Engine,
    Script,
    engines,
    good_prefill,
    sse,
)

PROMPT_IDS = [11, 12, 13]


def event(text: str, ids: list[int], *, first: bool = False, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids}
    if first:
        choice["prompt_token_ids"] = PROMPT_IDS
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": MODEL}
    return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"


def decode_failing_after_one_token(bad: bytes, asked: list[dict[str, Any]]) -> Script:
    """A decode that sends one token then `bad`, for a PD request; the rest, for a request without KV."""

    def script(req: dict[str, Any]) -> bytes:
        if req.get("kv_transfer_params"):
            return sse(event(" one", [101], first=True), bad)
        asked.append(req)
        return sse(event(" two", [102], first=True), event(" three", [103], finish="length"), b"data: [DONE]\n\n")

    return script


@pytest.mark.parametrize(
    "bad", [b"data: <html>oops</html>\n\n", b'data: {"choices": [\n\n', VLLM_ERROR], ids=["not JSON", "cut", "error"]
)
def test_a_decode_answering_garbage_mid_stream_is_resumed(engines: Callable[[Script], Engine], bad: bytes) -> None:  # noqa: F811
    asked: list[dict[str, Any]] = []
    p = engines(good_prefill)
    d1, d2 = engines(decode_failing_after_one_token(bad, asked)), engines(decode_failing_after_one_token(bad, asked))
    with Deployment(prefill=[p.url], decode=[d1.url, d2.url], model=MODEL, first_token_from_prefill=False) as r:
        r.wait_available(*(e.url.removeprefix("http://").replace(":", "-") for e in (p, d1, d2)))
        chunks = list(r.openai().completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, stream=True))
    assert "".join(c.text for c in chunks for c in c.choices) == " one two three"
    assert all(getattr(c, "token_ids", None) is None for k in chunks for c in k.choices)  # not asked for
    [rest] = asked
    assert rest["prompt"] == [*PROMPT_IDS, 101] and rest["max_tokens"] == 2 and "kv_transfer_params" not in rest
    assert rest["return_token_ids"] is True and rest["stream"] is True

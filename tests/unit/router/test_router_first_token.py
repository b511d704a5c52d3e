"""Which requests take their first token from the prefill, and what the client and the decode get
(`router/first_token.py`, pure). The e2e equality tests prove the tokens against one real vLLM."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pdgate.router.answers import PatchingSend, PrefillFacts, patch_usage
from pdgate.router.first_token import FirstToken, decode_body, eligible, first_event, read

BASE: dict[str, Any] = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "stream": True}


def _answer(**choice: Any) -> dict[str, Any]:
    c = {"index": 0, "text": " Paris", "finish_reason": "length", "token_ids": [42], "prompt_token_ids": [1, 2, 3]}
    c.update(choice)
    return {"id": "cmpl-abc", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [c]}


@pytest.mark.parametrize(
    "body",
    [
        BASE,
        {**BASE, "prompt": [5, 6, 7]},
        {**BASE, "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1},
        {**BASE, "stream_options": {"include_usage": True}, "ignore_eos": True, "stop_token_ids": [2]},
        {**BASE, "seed": 7, "temperature": 0},
        {**BASE, "n": 1, "echo": False, "logprobs": None, "stop": [], "presence_penalty": 0, "min_tokens": 0},
    ],
)
def test_streamed_completions_whose_fields_survive_the_shift_are_eligible(body: dict[str, Any]) -> None:
    assert eligible(body, completions=True, max_model_len=4096)


@pytest.mark.parametrize(
    ("why", "body", "completions", "limit"),
    [
        ("chat", {**BASE}, False, None),
        ("not streamed", {**BASE, "stream": False}, True, None),
        ("stream absent", {k: v for k, v in BASE.items() if k != "stream"}, True, None),
        ("max_tokens absent", {k: v for k, v in BASE.items() if k != "max_tokens"}, True, None),
        ("one token asked", {**BASE, "max_tokens": 1}, True, None),
        ("a stop string could span the first two tokens", {**BASE, "stop": ["\n"]}, True, None),
        ("a stop string", {**BASE, "stop": "x"}, True, None),
        ("penalties read the output", {**BASE, "frequency_penalty": 0.5}, True, None),
        ("presence penalty", {**BASE, "presence_penalty": 0.1}, True, None),
        ("min_tokens reads the output", {**BASE, "min_tokens": 3}, True, None),
        ("logprobs start at the first token", {**BASE, "logprobs": 2}, True, None),
        ("echo", {**BASE, "echo": True}, True, None),
        ("n", {**BASE, "n": 2}, True, None),
        ("seed with sampling", {**BASE, "seed": 7}, True, None),
        ("seed with temperature 0.5", {**BASE, "seed": 7, "temperature": 0.5}, True, None),
        ("guided decoding", {**BASE, "response_format": {"type": "json_object"}}, True, None),
        ("an unknown field", {**BASE, "bad_words": ["x"]}, True, None),
        ("continuous usage", {**BASE, "stream_options": {"continuous_usage_stats": True}}, True, None),
        ("prompt embeds", {**BASE, "prompt": None, "prompt_embeds": "..."}, True, None),
        ("past max_model_len", {**BASE, "prompt": [1] * 10, "max_tokens": 7}, True, 16),
    ],
)
def test_what_the_decode_could_not_continue_keeps_the_classic_path(
    why: str, body: dict[str, Any], completions: bool, limit: int | None
) -> None:
    assert not eligible(body, completions=completions, max_model_len=limit), why


def test_a_whole_first_token_is_read_from_the_prefills_answer() -> None:
    ft = read(_answer(), max_tokens=8, max_model_len=None)
    assert ft == FirstToken("cmpl-abc", 1700000000, "m", " Paris", 42, [1, 2, 3])


@pytest.mark.parametrize(
    ("why", "answer", "limit"),
    [
        ("the first token ended the answer", _answer(finish_reason="stop"), None),
        ("no text (a special token)", _answer(text=""), None),
        ("an incomplete UTF-8 character", _answer(text="\ufffd"), None),
        ("no token ids (an engine without return_token_ids)", _answer(token_ids=None), None),
        ("no prompt ids", _answer(prompt_token_ids=None), None),
        ("two tokens", _answer(token_ids=[1, 2]), None),
        ("prompt grown by the first token would not fit", _answer(prompt_token_ids=[1] * 9), 16),
        ("no answer", None, None),
        ("no choices", {"id": "x", "created": 1, "model": "m", "choices": []}, None),
    ],
)
def test_a_first_token_the_decode_cannot_follow_is_not_read(why: str, answer: Any, limit: int | None) -> None:
    assert read(answer, max_tokens=8, max_model_len=limit) is None, why


def test_the_first_event_has_vllms_chunk_shape() -> None:
    ft = FirstToken("cmpl-abc", 1700000000, "m", " Paris", 42, [1, 2, 3])
    raw = first_event(ft)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    chunk = orjson.loads(raw[6:])
    assert list(chunk) == ["id", "object", "created", "model", "choices"]
    assert chunk["choices"] == [
        {
            "index": 0,
            "text": " Paris",
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    ]


def test_the_decode_continues_after_the_first_token() -> None:
    ft = FirstToken("cmpl-abc", 1700000000, "m", " Paris", 42, [1, 2, 3])
    body = {**BASE, "temperature": 0.7}
    out = decode_body(body, ft)
    assert out == {**body, "prompt": [1, 2, 3, 42], "max_tokens": 7}
    assert body["prompt"] == BASE["prompt"]  # the client's body is not changed


def test_usage_moves_the_first_token_back_to_the_completion() -> None:
    usage: dict[str, Any] = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    patch_usage(usage, PrefillFacts(3, first_token=True))
    assert usage == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_with_return_token_ids_the_first_event_carries_the_prompts_ids() -> None:
    ft = FirstToken("cmpl-abc", 1700000000, "m", " Paris", 42, [1, 2, 3])
    (choice,) = orjson.loads(first_event(ft, token_ids=True)[6:])["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == ([1, 2, 3], [42])
    assert eligible({**BASE, "return_token_ids": True}, completions=True, max_model_len=None)


async def test_the_decodes_prompt_ids_are_taken_out_and_its_usage_shifted() -> None:
    """The decode's first event lists its prompt, which ends with the first token the client already has."""
    sent: list[dict[str, Any]] = []

    async def client(msg: dict[str, Any]) -> None:
        sent.append(msg)

    def ev(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    first = {"choices": [{"index": 0, "text": " is", "prompt_token_ids": [1, 2, 3, 42], "token_ids": [7]}]}
    second = {"choices": [{"index": 0, "text": " a", "prompt_token_ids": None, "token_ids": [8]}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    send = PatchingSend(client, PrefillFacts(3, first_token=True), False, drop_prompt_ids=True)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    stream = ev(first) + ev(second) + ev(usage) + b"data: [DONE]\n\n"
    await send({"type": "http.response.body", "body": stream[:30], "more_body": True})  # cut mid-event
    await send({"type": "http.response.body", "body": stream[30:], "more_body": False})
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert [c["prompt_token_ids"] for e in events[:2] for c in e["choices"]] == [None, None]
    assert [c["token_ids"] for e in events[:2] for c in e["choices"]] == [[7], [8]]
    assert events[2]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert body.endswith(b"data: [DONE]\n\n")

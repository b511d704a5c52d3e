"""bodies.py: what the prefill and decode copies of a request contain, and what is refused."""

from __future__ import annotations

import orjson
import pytest
from pdgate.router.bodies import (
    CHAT,
    COMPLETIONS,
    SplicedBody,
    decode_body,
    decode_params,
    kv_params_from_prefill,
    parse_json,
    prefill_body,
    prefill_params,
    request_facts,
    split_prompts,
    with_fields,
)
from pdgate.router.errors import BadRequest, PrefillFailed

from pdgate.contract import RouterClaim, with_claim


def test_prefill_body_rewrites_only_the_pd_fields() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 100,
        "max_completion_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "min_completion_tokens": 5,
        "top_k": 7,
        "ignore_eos": True,
        "kv_transfer_params": {"client": "value"},
    }
    params = prefill_params("pd-1", 42, "http://meta:1")
    out = orjson.loads(prefill_body(body, params))
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False
    for gone in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert gone not in out
    assert out["top_k"] == 7 and out["ignore_eos"] is True and out["prompt"] == "hi"
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "pd-1",
        "kv_key": 42,
        "metaserver": "http://meta:1",
    }
    assert body["max_tokens"] == 100 and body["stream"] is True  # the client's dict is untouched


def test_prefill_body_adds_no_max_completion_tokens_when_absent() -> None:
    out = orjson.loads(prefill_body({"prompt": "x"}, prefill_params("t", 1, None)))
    assert "max_completion_tokens" not in out
    assert "metaserver" not in out["kv_transfer_params"]


def test_decode_gets_the_client_body_with_the_prefill_params() -> None:
    from_p = {"do_remote_prefill": True, "remote_engine_id": "p1", "remote_block_ids": [[1, 2]], "kv_key": 9}
    params = decode_params(from_p, "pd-1", 42, "http://meta:1")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_id"] == "pd-1"
    assert params["kv_key"] == 9  # the prefill's own value wins
    assert params["remote_block_ids"] == [[1, 2]] and params["metaserver"] == "http://meta:1"
    body = {"prompt": "hi", "stream": True, "min_tokens": 3, "stream_options": {"include_usage": True}}
    out = orjson.loads(decode_body(body, params))
    assert out["stream"] is True and out["min_tokens"] == 3 and out["stream_options"] == {"include_usage": True}
    assert out["kv_transfer_params"] == params


@pytest.mark.parametrize(
    "raw",
    [b'{"kv_transfer_params": null}', b'{"choices": []}', b'{"kv_transfer_params": {}}', b"[1]", b"not json"],
)
def test_a_prefill_answer_without_params_is_a_prefill_failure(raw: bytes) -> None:
    with pytest.raises(PrefillFailed):
        kv_params_from_prefill(raw)


def test_several_prompts_split_into_one_body_each_in_order() -> None:
    body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 3}
    assert split_prompts(body) == [{"model": "m", "prompt": p, "max_tokens": 3} for p in ("a", "b", "c")]
    assert split_prompts({"prompt": [[1, 2], [3]]}) == [{"prompt": [1, 2]}, {"prompt": [3]}]
    for single in ({"prompt": "a"}, {"prompt": ["a"]}, {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]}):
        assert split_prompts(single) is None


def test_prefill_copy_asks_one_sample_and_decode_copy_leaves_prompt_logprobs_to_the_prefill() -> None:
    body = {"prompt": "x", "n": 3, "best_of": 3, "prompt_logprobs": 2, "max_tokens": 9}
    p = orjson.loads(prefill_body(body, {"transfer_id": "t"}))
    assert p["n"] == 1 and "best_of" not in p and p["prompt_logprobs"] == 2 and p["max_tokens"] == 1
    d = orjson.loads(decode_body(body, {"transfer_id": "t"}))
    assert "prompt_logprobs" not in d and d["n"] == 3 and d["max_tokens"] == 9


def test_single_prompt_shapes_are_accepted() -> None:
    assert request_facts({"prompt": ["only"]}, COMPLETIONS, 64).prefix == b"only"
    ids = request_facts({"prompt": [5, 6, 7]}, COMPLETIONS, 64)
    assert ids.prompt_tokens == 3 and ids.prefix == b"[5,6,7]"
    assert request_facts({"prompt": [[5, 6]]}, COMPLETIONS, 64).prompt_tokens == 2


def test_chat_prefix_covers_every_message_not_only_the_system_prompt() -> None:
    system = {"role": "system", "content": "You are helpful."}
    a = request_facts({"messages": [system, {"role": "user", "content": "question A"}]}, CHAT, 256)
    b = request_facts({"messages": [system, {"role": "user", "content": "question B"}]}, CHAT, 256)
    assert a.prefix != b.prefix
    assert a.prefix.startswith(b"system") and b"question A" in a.prefix
    parts = request_facts({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}, CHAT, 256)
    assert b"hello" in parts.prefix


def test_facts_read_stream_model_and_max_tokens() -> None:
    f = request_facts({"model": "m", "stream": True, "prompt": "x" * 400, "max_tokens": 9}, COMPLETIONS, 100)
    assert (f.model, f.stream, f.max_tokens, f.prompt_tokens, len(f.prefix)) == ("m", True, 9, 100, 100)
    chat = request_facts({"messages": [], "max_completion_tokens": 4}, CHAT, 10)
    assert chat.max_tokens == 4 and chat.model is None
    assert request_facts({"prompt": "x"}, COMPLETIONS, 10).max_tokens == 16


@pytest.mark.parametrize("body", [{"model": 3}, {"stream": "yes"}])
def test_bad_field_types_are_refused(body: dict) -> None:
    with pytest.raises(BadRequest):
        request_facts(body, COMPLETIONS, 10)


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"s"'])
def test_body_must_be_a_json_object(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json(raw)


def _rewritten(body: dict[str, object], prefill: bool, kv: dict[str, object]) -> dict[str, object]:
    """The hop's body as a dict rewrite would make it: the reference the spliced encoding must equal."""
    out = dict(body)
    if prefill:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        if "n" in out:
            out["n"] = 1
        for gone in ("best_of", "stream_options", "min_tokens", "min_completion_tokens"):
            out.pop(gone, None)
    else:
        out.pop("prompt_logprobs", None)
    out["kv_transfer_params"] = kv
    return out


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "x"},
        {"model": "m", "messages": [{"role": "user", "content": 'hé \u2028 "q"'}], "max_completion_tokens": 7},
        {
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 2,
            "best_of": 3,
            "min_tokens": 1,
            "prompt_logprobs": 2,
            "kv_transfer_params": {"from": "client"},
            "temperature": 0.5,
        },
    ],
)
def test_spliced_body_is_the_same_json_as_rewriting_the_dict(body: dict[str, object]) -> None:
    spliced = SplicedBody(body)
    kv = {"transfer_id": "pd-1", "remote_block_ids": [[1, 2]]}
    assert orjson.loads(spliced.prefill(kv)) == _rewritten(body, True, kv)
    assert orjson.loads(spliced.decode(kv)) == _rewritten(body, False, kv)
    assert orjson.loads(spliced.decode(orjson.Fragment(orjson.dumps(kv)))) == _rewritten(body, False, kv)
    assert body == dict(body)  # the client's body is left as it came


def test_with_fields_adds_a_claim_to_encoded_params_as_with_claim_does() -> None:
    kv = decode_params({"remote_engine_id": "p1", "remote_block_ids": [[3]]}, "pd-1", 7, "http://m")
    claim = RouterClaim("d1", 123.5, 30.0)
    spliced = with_fields(orjson.dumps(kv), with_claim({}, claim, siblings=3))
    assert orjson.loads(spliced) == with_claim(kv, claim, siblings=3)
    assert with_fields(orjson.dumps(kv), with_claim({}, None)) == orjson.dumps(kv)

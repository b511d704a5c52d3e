"""answers.py and fanout.py's merge, pure: what the prefill's answer adds to the client's, and how several
prompts' answers become one (the way vLLM merges its own)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pdgate.router import validation
from pdgate.router.answers import PatchingSend, PrefillFacts, patch_answer, prefill_facts, split_events
from pdgate.router.bodies import kv_params_from_prefill
from pdgate.router.errors import BadRequest, ContextTooLong, UnsupportedByPD
from pdgate.router.fanout import merge_answers, merge_usage
from pdgate.router.validation import check_context, check_pd_support

from pdgate.asgi import Message
from pdgate.errors import Code


def prefill_answer(**kv: Any) -> dict[str, Any]:
    """A prefill's answer as the dispatcher keeps it (`kv_params_from_prefill` parsed it)."""
    raw = orjson.dumps(
        {
            "choices": [{"index": 0, "text": "x", "prompt_logprobs": [None, {"5": {"logprob": -1.0}}]}],
            "prompt_logprobs": [None, {"7": {"logprob": -2.0}}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41},
            "kv_transfer_params": kv or {"transfer_id": "t"},
        }
    )
    answer, _ = kv_params_from_prefill(raw)
    return answer


def test_the_transferred_count_comes_from_the_prefills_params_else_its_usage() -> None:
    assert prefill_facts(prefill_answer(remote_num_tokens=32), chat=False).transferred == 32
    assert prefill_facts(prefill_answer(), chat=False).transferred == 40
    assert prefill_facts(None, chat=False) == PrefillFacts(None)  # no prefill answer was kept


def test_completion_and_chat_keep_prompt_logprobs_where_vllm_puts_them() -> None:
    box = prefill_answer(remote_num_tokens=40)
    completion = {"choices": [{"index": 0, "prompt_logprobs": None}], "usage": {"prompt_tokens": 40}}
    patch_answer(completion, prefill_facts(box, chat=False), chat=False)
    assert completion["choices"][0]["prompt_logprobs"] == [None, {"5": {"logprob": -1.0}}]
    chat: dict[str, Any] = {"choices": [{"index": 0}], "prompt_logprobs": None, "usage": {"prompt_tokens": 40}}
    patch_answer(chat, prefill_facts(box, chat=True), chat=True)
    assert chat["prompt_logprobs"] == [None, {"7": {"logprob": -2.0}}]
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}


@pytest.mark.parametrize(
    ("details", "transferred", "want"),
    [(None, 32, 32), ({"cached_tokens": 0}, 32, 32), ({"cached_tokens": 48}, 32, 48), (None, 99, 50)],
)
def test_cached_tokens_is_what_the_decode_did_not_compute(details: Any, transferred: int, want: int) -> None:
    answer: dict[str, Any] = {"usage": {"prompt_tokens": 50, "prompt_tokens_details": details}}
    patch_answer(answer, PrefillFacts(transferred), chat=False)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == want


async def test_a_whole_answer_is_reencoded_with_its_new_length() -> None:
    sent: list[Message] = []

    async def send(msg: Message) -> None:
        sent.append(msg)

    out = PatchingSend(send, PrefillFacts(3), chat=False)
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3}})
    await out({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    assert sent == []  # held until its length is known
    await out({"type": "http.response.body", "body": body, "more_body": False})
    got = sent[1]["body"]
    assert orjson.loads(got)["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert (b"content-length", str(len(got)).encode()) in sent[0]["headers"]


async def test_a_stream_split_mid_event_still_gets_its_usage_patched() -> None:
    sent: list[bytes] = []

    async def send(msg: Message) -> None:
        if msg["type"] == "http.response.body":
            sent.append(msg["body"])

    out = PatchingSend(send, PrefillFacts(4), chat=True)
    stream = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    )
    await out({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    cut = stream.index(b'"usage"') + 3
    await out({"type": "http.response.body", "body": stream[:cut], "more_body": True})
    await out({"type": "http.response.body", "body": stream[cut:], "more_body": True})
    await out({"type": "http.response.body", "body": b"", "more_body": False})
    events = [e for e in b"".join(sent).split(b"\n\n") if e]
    assert events[0] == stream.split(b"\n\n")[0], "events without usage pass byte for byte"
    assert orjson.loads(events[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert events[2] == b"data: [DONE]"


async def test_an_error_answer_passes_untouched() -> None:
    sent: list[Message] = []

    async def send(msg: Message) -> None:
        sent.append(msg)

    out = PatchingSend(send, PrefillFacts(4), chat=False)
    start: Message = {"type": "http.response.start", "status": 400, "headers": [(b"content-length", b"2")]}
    await out(start)
    await out({"type": "http.response.body", "body": b"{}", "more_body": False})
    assert sent == [start, {"type": "http.response.body", "body": b"{}", "more_body": False}]


def test_split_events_keeps_the_incomplete_tail() -> None:
    assert split_events(b"data: 1\n\ndata: 2") == (b"data: 1\n\n", b"data: 2")
    assert split_events(b"data: 1") == (b"", b"data: 1")


def test_merged_answers_are_in_prompt_order_with_summed_usage() -> None:
    def answer(text: str, prompt: int, cached: int) -> dict[str, Any]:
        usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
        return {"id": f"cmpl-{text}", "choices": [{"index": 0, "text": text}], "usage": usage, "kv_transfer_params": {}}

    merged = merge_answers([answer("a", 3, 3), answer("b", 5, 4)], n=1)
    assert merged["id"] == "cmpl-a" and merged["kv_transfer_params"] is None
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b")]
    assert merged["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 4,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 7},
    }
    two = merge_answers([{"choices": [{"index": 0}, {"index": 1}]}, {"choices": [{"index": 0}, {"index": 1}]}], n=2)
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert merge_usage([None, None]) is None


def test_pd_rules_name_the_field() -> None:
    for body, param in (({"best_of": 2}, "best_of"), ({"use_beam_search": True}, "use_beam_search")):
        with pytest.raises(UnsupportedByPD) as info:
            check_pd_support(body)
        assert info.value.param == param and info.value.code == Code.UNSUPPORTED_BY_PD and info.value.status == 400
    check_pd_support({"n": 1, "best_of": 1, "use_beam_search": False})
    check_pd_support({"n": 4, "temperature": 0.7})  # n > 1 goes through PD (siblings share the handoff)
    with pytest.raises(BadRequest) as greedy:
        check_pd_support({"n": 2, "temperature": 0})
    assert greedy.value.param == "n" and "greedy" in greedy.value.message


def test_n_through_pd_is_one_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "N_THROUGH_PD", False)
    with pytest.raises(UnsupportedByPD) as info:
        check_pd_support({"n": 2, "temperature": 0.5})
    assert info.value.param == "n"


def test_context_rules_are_vllms_no_more() -> None:
    check_context({"prompt": list(range(90)), "max_tokens": 100}, "/v1/completions", 100)  # vLLM lowers max_tokens
    check_context({"prompt": list(range(200)), "truncate_prompt_tokens": 50}, "/v1/completions", 100)
    check_context({"messages": [], "max_tokens": 500, "max_completion_tokens": 10}, "/v1/chat/completions", 100)
    with pytest.raises(ContextTooLong) as info:
        check_context({"messages": [], "max_tokens": 500}, "/v1/chat/completions", 100)
    assert info.value.param == "max_tokens" and info.value.code == Code.CONTEXT_LENGTH_EXCEEDED

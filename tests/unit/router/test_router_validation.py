"""validation.py and loops.py: the request rule the router applies before dispatch, and self-addresses."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pdgate.router.bodies import CHAT, COMPLETIONS
from pdgate.router.loops import is_own_address
from pdgate.router.validation import MAX_PROMPTS, InvalidField, validate_request


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi"},
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True},
        {"prompt": [[1, 2], [3]], "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "max_tokens": None, "model": None, "anything_else": {"kept": [1, {"a": None}]}},
        {"prompt_embeds": "base64..."},
    ],
)
def test_valid_completion_bodies_pass(body: dict[str, Any]) -> None:
    validate_request(body, COMPLETIONS)


def test_the_most_prompts_one_request_may_hold_pass() -> None:
    validate_request({"prompt": ["a"] * MAX_PROMPTS}, COMPLETIONS)
    validate_request({"prompt": [[1, 2]] * MAX_PROMPTS}, COMPLETIONS)
    validate_request({"prompt": [7] * (MAX_PROMPTS * 4)}, COMPLETIONS)  # token ids of one prompt: not a count


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "7"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2**53}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "stream": "true"}, "stream"),
        ({"prompt": "x", "stream_options": "yes"}, "stream_options"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),  # each prompt is a PD pair: bounded
        ({"prompt": [[1]] * (MAX_PROMPTS + 1)}, "prompt"),
    ],
)
def test_bad_completion_fields_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as caught:
        validate_request(body, COMPLETIONS)
    err = caught.value
    assert err.status == 400 and err.param == param
    assert orjson.loads(err.body())["error"]["param"] == param


def test_chat_needs_messages_with_roles() -> None:
    validate_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, CHAT)
    validate_request({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, CHAT)
    for messages in (None, [], [{"content": "x"}], [{"role": 1}], [{"role": "user", "content": 3}]):
        with pytest.raises(InvalidField):
            validate_request({"messages": messages}, CHAT)
    with pytest.raises(InvalidField, match="max_completion_tokens"):
        validate_request({"messages": [{"role": "user"}], "max_completion_tokens": "9"}, CHAT)


def test_a_body_too_deep_to_re_encode_is_refused() -> None:
    deep: Any = 0
    for _ in range(260):
        deep = [deep]
    with pytest.raises(InvalidField, match="nested"):
        validate_request({"prompt": "x", "extra": deep}, COMPLETIONS)
    shallow: Any = 0
    for _ in range(100):
        shallow = {"k": shallow}
    validate_request({"prompt": "x", "extra": shallow}, COMPLETIONS)


@pytest.mark.parametrize(
    ("url", "server", "own"),
    [
        ("http://127.0.0.1:8000", ("127.0.0.1", 8000), True),
        ("http://localhost:8000/", ("127.0.0.1", 8000), True),
        ("http://[::1]:8000", ("127.0.0.1", 8000), True),
        ("http://10.0.0.5:8000", ("10.0.0.5", 8000), True),
        ("http://127.0.0.1:8001", ("127.0.0.1", 8000), False),
        ("http://10.0.0.6:8000", ("10.0.0.5", 8000), False),
        ("http://10.0.0.5:8000", None, False),
        ("http://h:99999", ("127.0.0.1", 8000), False),
    ],
)
def test_own_address(url: str, server: tuple[str, int] | None, own: bool) -> None:
    assert is_own_address(url, server) is own

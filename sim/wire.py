"""pdgate-sim's OpenAI wire format: request checks, prompts to tokens, answer bodies, errors, ASGI sends.

Tokens: by default a prompt counts in words and its output is derived from its text (`tokens_for`), and
token ids are never shown. With `--token-ids` a completion's prompt goes through a character "tokenizer"
instead (`char_prompt`), so that token ids travel both ways as vLLM's do (`return_token_ids`): a prompt
character's id is its code point, an output token's id is `OUTPUT_ID_BASE` plus its index in the
vocabulary (past Unicode, so the two never meet). A token-id prompt turns back into its text, and output
ids at its end count as tokens already generated: the sequence continues after them, exactly as it would
have gone on in one engine. That is what lets a test check a router that streams the prefill's first
token and has the decode continue on `prompt ids + first id` (router/first_token.py): the client's text
must equal the classic path's, token for token.

The request checks answer 400 the way vLLM does for a field of the wrong type or range: a client's bad
field must never look like an engine failure (a 5xx would count against the engine's breaker in a
router and take it out of rotation for everyone).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from pdgate.asgi import Receive, Send

__all__ = [
    "JSON_HEADERS",
    "OUTPUT_ID_BASE",
    "SSE_HEADERS",
    "CharPrompt",
    "Died",
    "QuietDeath",
    "Reject",
    "char_prompt",
    "chat_prompt",
    "continuation",
    "error_body",
    "event",
    "full_answer",
    "pause",
    "prompt_of",
    "read_body",
    "reply",
    "send_all",
    "tokens_for",
    "validate_completion",
    "with_length",
]

_VOCAB = (
    "the of and to in is was for on that with as by at from it an be this which or are have had not "
    "were but they his one all their there been has when who will more no if out so said what up its"
).split()
OUTPUT_ID_BASE = 0x110000  # an output token's id: this plus its vocabulary index (past every code point)
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Died(Exception):
    """Raised on purpose (--die-after-tokens): uvicorn then closes the connection mid-answer."""


class QuietDeath(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Died))


class Reject(Exception):
    """An answer other than 200, with vLLM's error body."""

    def __init__(self, status: int, message: str, code: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code if code is not None else status


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_count(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if not _is_int(value):
        raise Reject(400, f"{key} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise Reject(400, f"{key} must be at least 1, got {value}.")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt) or all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return
    raise Reject(400, "prompt must be a string, a list of strings, or token ids")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise Reject(400, "messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Reject(400, "each message must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise Reject(400, "message content must be a string or a list of parts")


def validate_completion(body: dict[str, Any], chat: bool) -> None:
    """400 for the fields the simulator reads when they have the wrong type or range."""
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise Reject(400, "model must be a string")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise Reject(400, "stream must be a boolean")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        _optional_count(body, key)
    if body.get("return_token_ids") is not None and not isinstance(body["return_token_ids"], bool):
        raise Reject(400, "return_token_ids must be a boolean")
    for key in ("stream_options", "kv_transfer_params"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise Reject(400, f"{key} must be an object")
    if chat:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))


def _words(text: str) -> int:
    return max(1, len(text.split()))


def prompt_of(body: dict[str, Any], chat: bool) -> tuple[str, int]:
    """(prompt text, prompt tokens counted in words) of a validated body."""
    if chat:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        text = "\n".join(parts)
        return text, _words(text) + 4 * len(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return " ".join(map(str, prompt)), len(prompt)
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return " ".join(map(str, prompt)), len(prompt)
    return str(prompt), _words(str(prompt))


def _indices(text: str, n: int) -> list[int]:
    """Vocabulary indices of the first `n` tokens of `text`'s answer (token `i` depends on `i` alone, so
    a longer answer starts with the shorter one)."""
    seed = int.from_bytes(hashlib.blake2b(text.encode()[:4096], digest_size=8).digest(), "little")
    v = len(_VOCAB)
    return [(seed >> (i % 48) ^ i * 2654435761) % v for i in range(n)]


def tokens_for(text: str, n: int) -> list[str]:
    """`n` tokens derived from the prompt: the same prompt always gets the same text."""
    return [" " + _VOCAB[j] for j in _indices(text, n)]


def continuation(text: str, n: int, skip: int = 0) -> tuple[list[str], list[int]]:
    """Tokens `skip` .. `skip + n` of `text`'s answer and their ids (`OUTPUT_ID_BASE` + vocabulary index):
    a sequence that already holds `skip` of them goes on with the next one (`--token-ids`)."""
    idx = _indices(text, skip + n)[skip:]
    return [" " + _VOCAB[j] for j in idx], [OUTPUT_ID_BASE + j for j in idx]


@dataclass(frozen=True)
class CharPrompt:
    """A completion's prompt under the character tokenizer (`--token-ids`, module doc)."""

    text: str  # what the answer is derived from: the prompt without the tokens already generated
    ids: list[int]  # the prompt's token ids, as the engine counts and returns them
    generated: int  # output ids at the end of the prompt: tokens this sequence already holds


def char_prompt(body: dict[str, Any]) -> CharPrompt:
    """The character tokenizer's view of a validated completion's (first) prompt; an id that is neither a
    code point nor an output token is out of the vocabulary: 400, as from vLLM."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        prompt = prompt[0]
    ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
    top = OUTPUT_ID_BASE + len(_VOCAB)
    for t in ids:
        if not 0 <= t < top:
            raise Reject(400, f"Token id {t} is out of vocabulary")
    generated = 0
    while generated < len(ids) and ids[-1 - generated] >= OUTPUT_ID_BASE:
        generated += 1
    head = ids[: len(ids) - generated]
    text = "".join(chr(t) if t < OUTPUT_ID_BASE else " " + _VOCAB[t - OUTPUT_ID_BASE] for t in head)
    return CharPrompt(text, ids, generated)


def chat_prompt(body: dict[str, Any]) -> CharPrompt:
    """A chat's prompt under the character tokenizer: its template is the messages' contents joined by
    newlines (`prompt_of`), whose code points are the ids vLLM would return as `prompt_token_ids`."""
    text, _ = prompt_of(body, True)
    return CharPrompt(text, [ord(c) for c in text], 0)


def full_answer(
    body: dict[str, Any],
    tokens: list[str],
    prompt_tokens: int,
    chat: bool,
    rid: str,
    kv: dict[str, Any] | None,
    ids: tuple[list[int], list[int]] | None = None,
    *,
    finish: tuple[str, Any] = ("length", None),
    n: int = 1,
    logprobs: Any = None,
) -> bytes:
    """The whole answer; `ids` (prompt ids, output ids) when the client asked for `return_token_ids`;
    `finish` (finish_reason, stop_reason), `n` identical choices, their `logprobs` (sim/sampling.py)."""
    text = "".join(tokens)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n * len(tokens)}
    usage["total_tokens"] = prompt_tokens + n * len(tokens)
    model = body.get("model") or ""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=logprobs, finish_reason=finish[0], stop_reason=finish[1])
    if ids is not None and chat:  # where vLLM's ChatCompletionResponse has them
        choice.update(token_ids=ids[1])
    elif ids is not None:  # where vLLM's CompletionResponseChoice has them
        choice.update(token_ids=ids[1], prompt_logprobs=None, prompt_token_ids=ids[0])
    out = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [{**choice, "index": j} for j in range(n)],
        "usage": usage,
        "kv_transfer_params": kv,
    }
    if ids is not None and chat:
        out["prompt_token_ids"] = ids[0]
    return orjson.dumps(out)


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_body(exc: Reject) -> dict[str, Any]:
    kind = "BadRequestError" if exc.status < 500 else "InternalServerError"
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}


def with_length(headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    return [*headers, (b"content-length", str(len(body)).encode())]


async def send_all(send: Send, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": with_length(headers, body)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def reply(send: Send, status: int, obj: Any) -> None:
    await send_all(send, status, JSON_HEADERS, orjson.dumps(obj))


async def read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)


async def pause(seconds: float, disconnected: asyncio.Future[Any]) -> bool:
    """Sleep, unless the client goes away first: False then."""
    if seconds <= 0:
        return not disconnected.done()
    done, _ = await asyncio.wait({disconnected}, timeout=seconds)
    return not done

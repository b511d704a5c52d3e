"""pdgate-sim's OpenAI wire format: prompts to tokens, answer bodies, errors, and raw ASGI send helpers."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

_VOCAB = (
    "the of and to in is was for on that with as by at from it an be this which or are have had not "
    "were but they his one all their there been has when who will more no if out so said what up its"
).split()
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class _Died(Exception):
    """Raised on purpose (--die-after-tokens): uvicorn then closes the connection mid-answer."""


class _QuietDeath(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Died))


class _Reject(Exception):
    def __init__(self, status: int, message: str, code: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code if code is not None else status


def _words(text: str) -> int:
    return max(1, len(text.split()))


def _prompt(body: dict[str, Any], chat: bool) -> tuple[str, int]:
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


def _tokens(text: str, n: int) -> list[str]:
    seed = int.from_bytes(hashlib.blake2b(text.encode()[:4096], digest_size=8).digest(), "little")
    v = len(_VOCAB)
    return [" " + _VOCAB[(seed >> (i % 48) ^ i * 2654435761) % v] for i in range(n)]


def _full(
    body: dict[str, Any], tokens: list[str], prompt_tokens: int, chat: bool, rid: str, kv: dict[str, Any] | None
) -> bytes:
    text = "".join(tokens)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens)}
    usage["total_tokens"] = prompt_tokens + len(tokens)
    model = body.get("model") or ""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason="length", stop_reason=None)
    out = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "kv_transfer_params": kv,
    }
    return orjson.dumps(out)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(exc: _Reject) -> dict[str, Any]:
    kind = "BadRequestError" if exc.status < 500 else "InternalServerError"
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}


def _with_length(headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    return [*headers, (b"content-length", str(len(body)).encode())]


async def _send_all(send: Callable, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _with_length(headers, body)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _reply(send: Callable, status: int, obj: Any) -> None:
    await _send_all(send, status, _JSON, orjson.dumps(obj))


async def _body(receive: Callable) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)


async def _pause(seconds: float, disconnected: asyncio.Future[Any]) -> bool:
    """Sleep, unless the client goes away first: False then."""
    if seconds <= 0:
        return not disconnected.done()
    done, _ = await asyncio.wait({disconnected}, timeout=seconds)
    return not done

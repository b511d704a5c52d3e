"""The OpenAI request fields the router reads or rewrites, and the prefill/decode bodies (pure).

The router reads `model`, `stream`, `prompt`/`messages` (for prefix affinity and a token estimate),
`max_tokens`/`max_completion_tokens`; it rewrites only what the PD protocol needs (vLLM's
`toy_proxy_server.py` and NIXL's docs): the prefill copy gets `max_tokens=1` (and
`max_completion_tokens=1` when present), `stream=false`, one sample (`n=1`, no `best_of`), no
`stream_options`, no `min_tokens`/`min_completion_tokens`, and our `kv_transfer_params`; the decode copy
is the client's body with the prefill's `kv_transfer_params` and without `prompt_logprobs`: vLLM
computes prompt logprobs only by running the prompt, so a decode asked for them ignores the transferred
KV and recomputes the whole prompt. The prefill computes them instead, and the router carries them from
the prefill's answer into the client's (`pdgate.router.answers`). Every other field passes through.

The `kv_transfer_params` of both hops are the contract's (`pdgate.contract`): the prefill's
request is `prefill_request`, and the decode's is `decode_request` of the prefill's answer. The router
reads that answer's fields only through `KVTransferParams.parse` (`attempts`: an answer it refuses is the
prefill's failure) and forwards the dict it checked, untyped keys included.

A completion with several prompts is split (`split_prompts`) into one request per prompt, each with
its own prefill/decode pair (`pdgate.router.fanout`): vLLM returns the `kv_transfer_params` of the first
prompt only, so one prefill of all of them would leave the others to be recomputed on decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pdgate.router.errors import BadRequest, PrefillFailed

from pdgate.contract import decode_request, prefill_request

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "RequestFacts",
    "SplicedBody",
    "decode_body",
    "decode_params",
    "kv_params_from_prefill",
    "parse_json",
    "prefill_body",
    "prefill_params",
    "request_facts",
    "split_prompts",
    "with_fields",
]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestFacts:
    """What routing needs to know about one request; computed once, never mutated."""

    endpoint: str
    model: str | None
    stream: bool
    prompt_tokens: int  # estimate: characters / 4, or the length of a token-id prompt
    max_tokens: int
    prefix: bytes  # the first `prefix_chars` of the prompt, for prefix affinity
    token_ids: Sequence[int] | None = None  # a completions prompt given as token ids (kv-event prefix lookups)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _prompt_text(prompt: Any, limit: int) -> tuple[bytes, int]:
    """(prefix bytes, estimated tokens) of a completions `prompt`."""
    if isinstance(prompt, str):
        return prompt[:limit].encode(), max(1, len(prompt) // 4)
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt[:4]):  # one prompt as token ids
            return orjson.dumps(prompt[:limit]), len(prompt)
        if prompt:  # several prompts are split before this (`split_prompts`); the first stands for all
            return _prompt_text(prompt[0], limit)
    return b"", 1


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _chat_text(messages: Any, limit: int) -> tuple[bytes, int]:
    """(prefix bytes, estimated tokens) of chat `messages`: role and text of every message in order,
    so two conversations share a prefix exactly when their first messages agree."""
    if not isinstance(messages, list):
        return b"", 1
    parts: list[str] = []
    size = 0
    chars = 0
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        text = _content_text(msg.get("content"))
        chars += len(text)
        if size < limit:
            piece = f"{msg.get('role', '')}\x1f{text}\x1e"
            parts.append(piece)
            size += len(piece)
    return "".join(parts)[:limit].encode(), max(1, chars // 4)


def request_facts(body: dict[str, Any], endpoint: str, prefix_chars: int) -> RequestFacts:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    if endpoint == CHAT:
        prefix, tokens = _chat_text(body.get("messages"), prefix_chars)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prefix, tokens = _prompt_text(body.get("prompt"), prefix_chars)
        max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        max_tokens = _DEFAULT_MAX_TOKENS
    ids = body.get("prompt") if endpoint != CHAT else None
    token_ids = ids if isinstance(ids, list) and ids and isinstance(ids[0], int) else None  # validated shape
    return RequestFacts(endpoint, model, stream, tokens, max_tokens, prefix, token_ids)


def split_prompts(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One completions body per prompt when `prompt` holds several (strings or token-id lists), in order;
    None for a single prompt. Run after validation, which checked the prompt's shape."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or not isinstance(prompt[0], (str, list)):
        return None
    return [{**body, "prompt": p} for p in prompt]


def prefill_params(transfer_id: str, kv_key: int, metaserver: str | None) -> dict[str, Any]:
    return prefill_request(transfer_id, kv_key=kv_key, metaserver=metaserver)


# The fields either hop rewrites or drops. Everything else in the client's body is the same on both hops,
# so `SplicedBody` encodes it once and each hop's payload is that encoding with the hop's own fields
# spliced in: a long prompt is serialized once per request, not once per hop and attempt.
_HOP_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "n",
    "best_of",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    "prompt_logprobs",
    "kv_transfer_params",
    "return_token_ids",
)


class SplicedBody:
    """The client's body encoded once without `_HOP_FIELDS`; `prefill`/`decode` splice each hop's fields
    onto it. Same JSON object as encoding the rewritten dict whole (`prefill_body`, `decode_body`); only
    the order of the keys differs."""

    __slots__ = ("_base", "_kept", "_own")

    def __init__(self, body: dict[str, Any], _shared: tuple[bytes, dict[str, Any]] | None = None) -> None:
        self._kept = {k: body[k] for k in _HOP_FIELDS if k in body}
        self._own: dict[str, Any] = {}
        if _shared is not None:  # `fan_out`'s: the base is shared with other prompts, this one adds its own
            self._base, self._own = _shared
            return
        rest = {k: v for k, v in body.items() if k not in self._kept} if self._kept else body
        encoded = orjson.dumps(rest)
        self._base = encoded[:-1] + b"," if len(encoded) > 2 else b"{"

    @classmethod
    def fan_out(cls, body: dict[str, Any], prompts: list[Any]) -> list[SplicedBody]:
        """One per prompt of a multi-prompt `body`: the same payloads as `SplicedBody({**body, "prompt":
        p})`, but everything but the prompt is encoded once for all of them. Why: a 4 MB field beside 64
        prompts was encoded 64 times, and the router's memory grew by 776 MB (issue #21)."""
        rest = {k: v for k, v in body.items() if k != "prompt" and k not in _HOP_FIELDS}
        encoded = orjson.dumps(rest)
        base = encoded[:-1] + b"," if len(encoded) > 2 else b"{"
        return [cls(body, (base, {"prompt": p})) for p in prompts]

    def _with(self, fields: dict[str, Any]) -> bytes:
        if self._own:
            fields = {**self._own, **fields}
        return self._base + orjson.dumps(fields)[1:]

    def prefill(self, kv_params: dict[str, Any], *, token_ids: bool = False) -> bytes:
        """The prefill copy; `token_ids`: ask vLLM for the prompt's and the first token's ids
        (`return_token_ids`), which a first token from the prefill needs (`first_token`)."""
        kept = self._kept
        fields: dict[str, Any] = {"max_tokens": 1, "stream": False}
        if token_ids:
            fields["return_token_ids"] = True
        if "max_completion_tokens" in kept:
            fields["max_completion_tokens"] = 1
        if "n" in kept:
            fields["n"] = 1
        if "prompt_logprobs" in kept:
            fields["prompt_logprobs"] = kept["prompt_logprobs"]
        fields["kv_transfer_params"] = kv_params
        return self._with(fields)

    def decode(self, kv_params: dict[str, Any] | orjson.Fragment) -> bytes:
        """The decode copy; `kv_params` may come already encoded (an `orjson.Fragment`, see `with_fields`)."""
        fields = {k: v for k, v in self._kept.items() if k != "prompt_logprobs" and k != "kv_transfer_params"}
        fields["kv_transfer_params"] = kv_params
        return self._with(fields)


def with_fields(encoded: bytes, fields: dict[str, Any]) -> bytes:
    """The JSON object `encoded` (a non-empty object, as `orjson.dumps` wrote it) with `fields` added,
    whose keys it must not hold already: what a claim adds to the decode's params, without encoding
    them again."""
    return encoded[:-1] + b"," + orjson.dumps(fields)[1:] if fields else encoded


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> bytes:
    """The prefill copy of `body` (see the module docstring); the request path uses `SplicedBody`."""
    return SplicedBody(body).prefill(kv_params)


def kv_params_from_prefill(raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill's answer, parsed, and its `kv_transfer_params`; a prefill that sent none failed (never
    decode without the KV: that would silently recompute the prompt). The answer is returned too, so that
    what the client's answer takes from it (`answers.prefill_facts`) needs no second parse."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PrefillFailed(f"prefill answered invalid JSON: {exc}") from exc
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params:
        raise PrefillFailed(
            "prefill answered without kv_transfer_params (is the engine started with a KV connector as producer?)"
        )
    return data, params


def decode_params(
    from_prefill: dict[str, Any], transfer_id: str, kv_key: int, metaserver: str | None
) -> dict[str, Any]:
    """The prefill's answer (read by `kv_params_from_prefill`) as the decode gets it."""
    return decode_request(from_prefill, transfer_id, kv_key=kv_key, metaserver=metaserver)


def decode_body(body: dict[str, Any], kv_params: dict[str, Any]) -> bytes:
    """The decode copy of `body`: no `prompt_logprobs` (see the module docstring), the prefill's params."""
    return SplicedBody(body).decode(kv_params)

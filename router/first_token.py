"""The first token from the prefill: a streamed completion's first token reaches the client as soon as the
prefill has sampled it, and the decode continues after it (pure; the proxy acts on it).

Why: the prefill samples the first token anyway (its copy asks for `max_tokens=1`). On the classic path
the client waits for a second engine pass before it sees that token: the router's decode leg, the
decode's intake, the load and a forward of the last prompt token, which at low load is most of what PD
adds to a single instance's time to first token. Here the client gets the prefill's token at once, and
the decode is asked for what comes after it: its prompt is the prefill's prompt token ids plus that token,
with one token fewer to generate. The decode loads the prefill's KV of every prompt token and computes
only the first token's position (the connector loads `min(remote_num_tokens, prompt)`), exactly the one
position the classic path computes too, so the decode does no more work and the answer ends one engine
step sooner.

The tokens are the ones one vLLM would give, not merely close to them: the first token is sampled from the
same distribution (the prefill is an instance running the same prompt), and every later token is sampled
on a sequence that holds it. Greedy outputs therefore equal the single instance's token for token (the
e2e equality tests). What a decode could not reproduce from a prompt that ends with the first token keeps
the classic path, decided from the body before the prefill (`eligible`) and from the prefill's answer
after it (`read`), before a byte goes to the client:
- only `/v1/completions` streamed with one prompt and one choice: a chat's decode would need its
  template's token ids back as a chat, which vLLM's chat route does not take;
- only fields whose meaning does not change when the first output token becomes the last prompt token
  (`_SAFE`). Stop strings are out (one could span the first and second token, and the decode never sees
  the first one's text); so are presence and frequency penalties, `min_tokens`, bad words and guided
  decoding (they read the output so far), logprobs and echo (their shape starts at the first token), and
  a seed with sampling (the seeded generator would start one draw late);
- only a pdgate prefill (it records the handoff): vLLM's stock NixlConnector loads the whole prompt it is
  given, and the prefill holds no KV for the first token's position;
- only when the prefill stopped for length with one whole token: a first token that ends the answer (EOS,
  a stop token) or whose text is an incomplete UTF-8 character (vLLM shows `\\ufffd` for it until the next
  token completes it) takes the classic path, as does a request whose `max_tokens` is under 2 or would not
  fit the model's length once the decode's prompt grows by one.

Usage stays the client's: the decode counts the first token as a prompt token, so its final usage event
gets one prompt token fewer and one completion token more (`answers.patch_usage`). With
`return_token_ids`, the prompt's ids go out in the first event, as vLLM sends them, and the decode's first
event, whose prompt ids end with the first token, has them taken out (`answers.PatchingSend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

__all__ = ["MAX_TOKEN_ID", "BadFirstToken", "FirstToken", "check", "decode_body", "eligible", "first_event", "read"]

# Completion fields whose meaning is the same when the first output token is the decode's last prompt
# token. Anything else in the body (present and not at its neutral value) keeps the classic path.
_SAFE = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "add_special_tokens",
        "user",
        "priority",
        "request_id",
        "kv_transfer_params",  # the router writes its own on both hops
        "return_token_ids",  # the first event carries the ids; the decode's prompt ids are taken out
        "seed",  # only with greedy sampling (checked below)
        "n",  # only 1
        "echo",  # only false
        "logprobs",  # only null
        "stop",  # only empty
        "presence_penalty",  # only 0
        "frequency_penalty",  # only 0
        "min_tokens",  # only 0
    }
)
_GREEDY = 1e-5  # vLLM's _SAMPLING_EPS
_REPLACEMENT = "\ufffd"
# The router does not know the model's vocabulary; every real one is far below this, and a decode's
# tokenizer refuses an id past its own vocabulary anyway. What this bound catches is an id no
# tokenizer has (negative, 2**63 - 1, a float), before it reaches the client.
MAX_TOKEN_ID = 2**31


def eligible(body: dict[str, Any], *, completions: bool, max_model_len: int | None) -> bool:
    """Whether this (validated) body may take its first token from the prefill (module doc); the prefill's
    answer still has the last word (`read`)."""
    if not completions or body.get("stream") is not True:
        return False
    if any(k not in _SAFE for k in body):
        return False
    prompt = body.get("prompt")
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and type(prompt[0]) is int):
        return False
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 2:
        return False
    if max_model_len is not None and isinstance(prompt, list) and len(prompt) + max_tokens > max_model_len:
        return False  # vLLM refuses it: let the classic path relay that refusal before any token
    if body.get("n", 1) != 1 or body.get("echo") or body.get("logprobs") is not None or body.get("stop"):
        return False
    if body.get("presence_penalty") or body.get("frequency_penalty") or body.get("min_tokens"):
        return False
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or opts.get("continuous_usage_stats")):
        return False
    if body.get("seed") is not None:
        temperature = body.get("temperature")
        if not isinstance(temperature, (int, float)) or temperature >= _GREEDY:
            return False
    return True


@dataclass(frozen=True)
class FirstToken:
    """The prefill's first token, as the client's first event and the decode's prompt need it."""

    answer_id: str
    created: int
    model: str
    text: str
    token_id: int
    prompt_token_ids: list[int]


class BadFirstToken(ValueError):
    """The prefill's answer to a request that asked for token ids is not one a vLLM prefill gives: the
    prefill's failure (retried on another prefill), never a token the client gets."""


def _ids(value: Any) -> TypeGuard[list[int]]:
    return type(value) is list and all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in value)


def check(answer: dict[str, Any], prompt: Any) -> None:
    """Refuse (`BadFirstToken`) a prefill answer whose first token could not be trusted, before a byte
    of it reaches the client: every token id it lists is an int in [0, MAX_TOKEN_ID), the fields the
    client's first event is built from have vLLM's types, and when the client sent token ids
    (`prompt`) the prefill's prompt ids are exactly those, else the decode would answer another prompt.
    A client that sent text trusts the prefill's tokenization (SECURITY.md). What `read` turns away for
    the classic path (a finish other than length, a partial character) is no failure and passes here."""
    choices = answer.get("choices")
    if choices is None:
        return
    if type(choices) is not list or not all(type(c) is dict for c in choices):
        raise BadFirstToken("its choices are not a list of objects")
    for c in choices:
        ids, prompt_ids, text = c.get("token_ids"), c.get("prompt_token_ids"), c.get("text")
        if ids is not None and not _ids(ids):
            raise BadFirstToken(f"its token_ids are not ids in [0, {MAX_TOKEN_ID})")
        if prompt_ids is not None and not _ids(prompt_ids):
            raise BadFirstToken(f"its prompt_token_ids are not ids in [0, {MAX_TOKEN_ID})")
        if text is not None and type(text) is not str:
            raise BadFirstToken("its text is not a string")
        if prompt_ids is not None and type(prompt) is list and prompt_ids != prompt:
            raise BadFirstToken("its prompt_token_ids are not the client's prompt")
    for key, kind in (("id", str), ("model", str), ("created", int)):
        if key in answer and type(answer[key]) is not kind:
            raise BadFirstToken(f"its {key} is not {'a string' if kind is str else 'an int'}")


def read(answer: dict[str, Any] | None, *, max_tokens: int, max_model_len: int | None) -> FirstToken | None:
    """The prefill's first token when the decode can continue after it (module doc), else None. The
    answer passed `check` (the dispatcher ran it while a retry was still possible)."""
    if answer is None:
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    text, ids, prompt_ids = c.get("text"), c.get("token_ids"), c.get("prompt_token_ids")
    if c.get("finish_reason") != "length" or not isinstance(text, str) or not text or text.endswith(_REPLACEMENT):
        return None
    if not _ids(ids) or len(ids) != 1:
        return None
    if not _ids(prompt_ids) or not prompt_ids:
        return None
    if max_model_len is not None and len(prompt_ids) + max_tokens > max_model_len:
        return None
    answer_id, created, model = answer.get("id"), answer.get("created"), answer.get("model")
    if not isinstance(answer_id, str) or type(created) is not int or not isinstance(model, str):
        return None
    return FirstToken(answer_id, created, model, text, ids[0], prompt_ids)


def first_event(ft: FirstToken, *, token_ids: bool = False) -> bytes:
    """The client's first SSE event, in the shape of vLLM's own completion chunks (its stream serializes
    them with `exclude_unset`: these keys, in this order). `token_ids`: the client asked for
    `return_token_ids`, so like vLLM's first chunk it carries the prompt's ids and the token's."""
    chunk = {
        "id": ft.answer_id,
        "object": "text_completion",
        "created": ft.created,
        "model": ft.model,
        "choices": [
            {
                "index": 0,
                "text": ft.text,
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": ft.prompt_token_ids if token_ids else None,
                "token_ids": [ft.token_id] if token_ids else None,
            }
        ],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def decode_body(body: dict[str, Any], ft: FirstToken) -> dict[str, Any]:
    """The client's body as the decode continues it: the prompt ends with the first token, one token fewer
    to generate, every other field as the client sent it."""
    return {**body, "prompt": [*ft.prompt_token_ids, ft.token_id], "max_tokens": body["max_tokens"] - 1}

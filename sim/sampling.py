"""What the simulator does with the sampling fields a resumed stream must carry over (router/resume.py):
`stop`, `logprobs` / `top_logprobs` and `n`. Deterministic, like every answer of the simulator: a token's
logprob is a function of its id, so a resumed stream can be compared with one engine's, field for field.

Simplified on purpose: a stop string ends the answer at the first output token whose text contains it
(that token is not output; `finish_reason` "stop", `stop_reason` the string); with `--token-ids` the `n`
choices of a request are the same sequence (the simulator does not sample; without it, one choice, as the
tests written before it expect).
"""

from __future__ import annotations

from typing import Any

from pdgate.sim.wire import OUTPUT_ID_BASE

__all__ = ["apply_stop", "choices", "logprobs_of"]


def apply_stop(body: dict[str, Any], tokens: list[str], ids: list[int]) -> tuple[list[str], list[int], str, Any]:
    """(tokens, ids, finish_reason, stop_reason) once the body's stop strings are applied."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str) and s]
    for i, tok in enumerate(tokens):
        for s in stops:
            if s in tok:
                return tokens[:i], ids[:i], "stop", s
    return tokens, ids, "length", None


def _value(token_id: int) -> float:
    return -((token_id - OUTPUT_ID_BASE) % 97 + 1) / 100


def logprobs_of(body: dict[str, Any], chat: bool, tokens: list[str], ids: list[int], offset: int = 0) -> Any:
    """The logprobs of `tokens` as vLLM shapes them for this body (None when not asked): a chat's
    {content: [...]} (`logprobs` true, `top_logprobs` k), a completion's {tokens, token_logprobs,
    top_logprobs, text_offset} (`logprobs` k); the top list holds the sampled token alone."""
    if chat:
        if not body.get("logprobs"):
            return None
        content = []
        for tok, t in zip(tokens, ids, strict=True):
            entry = {"token": tok, "logprob": _value(t), "bytes": list(tok.encode())}
            content.append({**entry, "top_logprobs": [entry] if body.get("top_logprobs") else []})
        return {"content": content}
    if body.get("logprobs") is None:
        return None
    offsets, at = [], offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": [_value(t) for t in ids],
        "tokens": list(tokens),
        "top_logprobs": [{tok: _value(t)} for tok, t in zip(tokens, ids, strict=True)],
    }


def choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if type(n) is int and n > 1 else 1

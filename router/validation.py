"""The request fields the router relies on, checked before any engine sees the request.

Why before dispatch: a body the router cannot handle must be the client's 400, never an engine's 5xx.
An engine that answers 500 to a malformed field counts as a failing instance, so five requests with
`"max_tokens": "7"` could open a healthy decode's breaker for every user. The checks cover what the
router reads or rewrites (`model`, `stream`, `max_tokens`, `max_completion_tokens`, `n`, the prompt or
the messages) and that the body can be re-encoded at all: orjson parses JSON nested a thousand deep
but encodes at most 254 levels, so a deeper body would fail only when the prefill copy is built.
Every other field passes through untouched; the engine validates it and its 4xx is relayed.

The same models document the two proxy routes in the router's OpenAPI (`app.py`), so the schema
and the runtime check are one rule. Types are strict: `"7"` is not an integer and `1` not a boolean.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import orjson
from pdgate.router.bodies import CHAT
from pdgate.router.errors import BadRequest, ContextTooLong, UnsupportedByPD
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

__all__ = [
    "MAX_PROMPTS",
    "N_THROUGH_PD",
    "ChatCompletionRequest",
    "CompletionRequest",
    "InvalidField",
    "check_context",
    "check_pd_support",
    "validate_request",
]

MAX_SAFE_INT = 2**53 - 1  # exact in a double, so in every JSON parser the body reaches
MAX_N = 128
# Prompts in one completions request: each becomes a PD pair of its own (`fanout.py`), all at once, so
# one request may not hold more than this many (a 32 MiB body of one-token prompts would be millions).
MAX_PROMPTS = 256
_GREEDY = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling

TokenCount = Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INT)]
TokenId = Annotated[int, Field(ge=0, le=2**64 - 1)]
_T = TypeVar("_T")
_NonEmpty = Annotated[list[_T], Field(min_length=1)]


class InvalidField(BadRequest):
    """400 naming the offending field in the OpenAI error's `param`, as OpenAI and vLLM do."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _tokens(items: list[Any]) -> bool:
    """Whether `items` holds only integers >= 0 that orjson keeps as integers (below 2**64).

    Read off the encoding rather than item by item (several times faster on long prompts): a float, a
    bool, null, a string, a negative number or a nested list each leave a character other than digits
    and commas between the outer brackets."""
    try:
        return not orjson.dumps(items)[1:-1].translate(None, b"0123456789,")
    except orjson.JSONEncodeError:  # an integer past 64 bits (not from a parsed body: orjson reads it as a float)
        return False


def _check_prompt(value: Any) -> Any:
    """A prompt as OpenAI defines it: a string, strings, token ids, or lists of token ids.

    Checked by hand: a pydantic union over a long token-id list is many times slower."""
    if value is None or type(value) is str:
        return value
    if type(value) is not list:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
    if not value:
        raise ValueError("must not be an empty list")
    first = type(value[0])
    if first in (str, list) and len(value) > MAX_PROMPTS:
        raise ValueError(f"holds {len(value)} prompts; one request may hold at most {MAX_PROMPTS}")
    if first is str:
        ok = all(type(p) is str for p in value)
    elif first is list:
        ok = all(type(p) is list and p and _tokens(p) for p in value)
    else:
        ok = _tokens(value)
    if not ok:
        raise ValueError(
            "a list prompt must hold only strings, only token ids (integers >= 0) or only non-empty lists of token ids"
        )
    return value


Prompt = Annotated[
    Any,
    PlainValidator(
        _check_prompt,
        json_schema_input_type=StrictStr
        | _NonEmpty[StrictStr]
        | _NonEmpty[TokenId]
        | _NonEmpty[_NonEmpty[TokenId]]
        | None,
    ),
]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = Field(None, description="default: the one model this router serves")
    stream: StrictBool | None = False
    max_tokens: TokenCount | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    use_beam_search: StrictBool | None = None
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Fields):
    """`POST /v1/completions`: the fields the router reads; every other field goes to the engines as sent."""

    prompt: Prompt = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Fields):
    """`POST /v1/chat/completions`: the fields the router reads; every other field goes to the engines as sent."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None


def _first_error(exc: ValidationError) -> InvalidField:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return InvalidField(f"'{where}': {err.get('msg', 'invalid value')}", param)


def validate_request(body: dict[str, Any], endpoint: str) -> None:
    """Raise `InvalidField` (400) unless the router can route and re-encode `body`."""
    model = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    try:
        model.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        raise InvalidField(
            f"the request body cannot be forwarded ({exc}): JSON nested more than 250 levels deep is refused",
            None,
        ) from None


N_THROUGH_PD = True
"""Whether `n > 1` goes through PD. vLLM runs the n samples of one request as n sibling requests that all
carry the request's `kv_transfer_params`; the router tells the decode how many (`siblings`, next to its
claim: `attempts`), so every sibling loads the one prefill's KV and the handoff is done after the last.
The answer equals a single vLLM's sample for sample (tests/e2e/test_drop_in.py, seeded sampling); the
prefill copy asks for one sample (`bodies.prefill_body`). Set False to refuse n > 1 with a 400 naming
`n` (for decodes whose connector cannot share one handoff between siblings)."""


def check_pd_support(body: dict[str, Any]) -> None:
    """Refuse (400 `pd_unsupported_parameter`, naming the field) what prefill/decode disaggregation cannot
    serve, before any engine work: otherwise the engines fail later and the client gets a 502 that
    blames them. Run after `validate_request` (the types are checked)."""
    if body.get("use_beam_search") is True:
        raise UnsupportedByPD(
            "beam search is not supported through prefill/decode disaggregation: vLLM runs it as one new "
            "request per step, each of which would need a prefill of its own; set use_beam_search to false "
            "or send it to a plain vLLM instance",
            "use_beam_search",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of > 1:
        raise UnsupportedByPD(
            f"best_of={best_of} is not supported through prefill/decode disaggregation (vLLM no longer runs "
            "best_of either); send n requests with different seeds and pick the best yourself",
            "best_of",
        )
    n = body.get("n")
    temperature = body.get("temperature")
    if n is not None and n > 1 and isinstance(temperature, (int, float)) and temperature < _GREEDY:
        # vLLM's own rule, in its words; checked here so that no prefill runs before the decode refuses
        raise InvalidField(f"n must be 1 when using greedy sampling, got {n}.", "n")
    if not N_THROUGH_PD and n is not None and n > 1:
        raise UnsupportedByPD(
            f"n={n} is not supported through prefill/decode disaggregation yet: the decode lets one request "
            "claim the prefill's KV and vLLM runs the n samples as n requests; send n requests with n=1 (and "
            "different seeds)",
            "n",
        )


def check_context(body: dict[str, Any], endpoint: str, max_model_len: int) -> None:
    """Refuse (400 `context_length_exceeded`, naming the field) what vLLM would refuse for the model's
    `max_model_len`, before the prefill runs: asked later, the decode refuses it after a whole prefill.

    vLLM's rules, no more: `max_tokens` (chat: `max_completion_tokens` when set) above max_model_len, and
    a prompt of more tokens than max_model_len. A prompt plus `max_tokens` beyond it is not an error:
    vLLM lowers max_tokens to what is left, and so does the decode. Text prompts are not counted here
    (that needs the tokenizer); the prefill refuses those itself, before computing anything.
    """
    param = (
        "max_completion_tokens" if endpoint == CHAT and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    asked = body.get(param)
    if asked is not None and asked > max_model_len:
        raise ContextTooLong(
            f"{param}={asked} cannot be greater than max_model_len={max_model_len}. Please request fewer "
            "output tokens.",
            param,
        )
    if endpoint == CHAT or body.get("truncate_prompt_tokens") is not None:
        return
    prompt = body.get("prompt")
    longest = 0
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            longest = len(prompt)
        elif isinstance(prompt[0], list):
            longest = max(len(p) for p in prompt)
    if longest > max_model_len:
        raise ContextTooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{longest} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            "the length of the input prompt.",
            "prompt",
        )


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body, as every refusal of the proxy routes is shaped (documentation only)."""

    error: ErrorDetail

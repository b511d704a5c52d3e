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
from pdgate.router.errors import BadRequest
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

__all__ = ["ChatCompletionRequest", "CompletionRequest", "InvalidField", "validate_request"]

MAX_SAFE_INT = 2**53 - 1  # exact in a double, so in every JSON parser the body reaches
MAX_N = 128

TokenCount = Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INT)]
TokenId = Annotated[int, Field(ge=0, le=2**64 - 1)]
_T = TypeVar("_T")
_NonEmpty = Annotated[list[_T], Field(min_length=1)]


class InvalidField(BadRequest):
    """400 naming the offending field in the OpenAI error's `param`, as OpenAI and vLLM do."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.openai_type, "code": self.code.value, "param": self.param}}
        )


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body, as every refusal of the proxy routes is shaped (documentation only)."""

    error: ErrorDetail

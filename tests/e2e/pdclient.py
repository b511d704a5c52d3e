"""What the end-to-end tests send and read: OpenAI requests with exact token-id prompts, and the
observables that prove where KV came from (connector counters, vLLM's /metrics, the ledger).

Every request asks vLLM for `return_token_ids`, so outputs are compared as token ids (exact), and
`ignore_eos`, so every answer has the same length whatever the random model prefers.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from openai import OpenAI
from pdgate.deploy.local.tiny_model import MODEL_NAME

from pdgate.models import Handoff

__all__ = [
    "MAX_TOKENS",
    "Answer",
    "Engine",
    "chat",
    "chat_messages",
    "complete",
    "delta",
    "engine_counters",
    "get_handoff",
    "live_handoffs",
    "metric",
    "observe",
    "openai_client",
    "prompt_ids",
    "ranked",
    "scrape",
    "wait_for",
]

MAX_TOKENS = 12
VOCAB = 2048
FIRST_ORDINARY_TOKEN = 3  # 0-2 are <|bos|> <|eos|> <|pad|>
_EXTRA = {"return_token_ids": True, "ignore_eos": True}

_WORDS = (
    "the quick brown fox jumps over lazy dog prefill decode cache block token layer head attention model "
    "server request response hello world alpha beta gamma delta river mountain ocean forest city road"
).split()


def openai_client(base_url: str, *, timeout: float = 300.0) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="pdgate-e2e", max_retries=0, timeout=timeout)


def prompt_ids(length: int, seed: int) -> list[int]:
    """A reproducible prompt of exactly `length` ordinary token ids, distinct per seed."""
    rng = random.Random(f"prompt-{length}-{seed}")
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(length)]


def chat_messages(n_words: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(f"chat-{n_words}-{seed}")
    text = " ".join(rng.choice(_WORDS) for _ in range(n_words))
    return [{"role": "system", "content": f"run {seed}"}, {"role": "user", "content": text}]


@dataclass(frozen=True)
class Answer:
    """One response, reduced to what the tests compare and what proves the KV path."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    headers: dict[str, str] = field(default_factory=dict, compare=False)

    def same_output(self, other: Answer) -> bool:
        return self.token_ids == other.token_ids and self.text == other.text


def _usage_fields(usage: Any) -> tuple[int | None, int | None]:
    if usage is None:
        return None, None
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return usage.prompt_tokens, cached


def _token_ids(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None and getattr(choice, "model_extra", None):
        ids = choice.model_extra.get("token_ids")
    if ids is None:
        raise AssertionError(f"the response carries no token_ids (return_token_ids was requested): {choice!r}")
    return list(ids)


def _request(stream: bool, max_tokens: int) -> dict[str, Any]:
    """What every completion and chat request of these tests asks for (greedy, usage in streams)."""
    return {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "extra_body": _EXTRA,
    }


def _answer(
    raw: Any, stream: bool, text_of: Callable[[Any], str], piece: Callable[[Any], tuple[list[int], str]]
) -> Answer:
    """A raw completion or chat response as an `Answer`: a whole one's first choice (`text_of` it), or a
    stream joined chunk by chunk (`piece`: a chunk choice's token ids and text). One reader for both
    endpoints, so that they compare the same way."""
    headers = {k.lower(): v for k, v in raw.headers.items()}
    if not stream:
        resp = raw.parse()
        choice = resp.choices[0]
        prompt_tokens, cached = _usage_fields(resp.usage)
        return Answer(tuple(_token_ids(choice)), text_of(choice), prompt_tokens, cached, choice.finish_reason, headers)
    ids: list[int] = []
    text: list[str] = []
    usage = None
    finish = None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            got, said = piece(choice)
            ids += got
            text.append(said)
            finish = choice.finish_reason or finish
    prompt_tokens, cached = _usage_fields(usage)
    return Answer(tuple(ids), "".join(text), prompt_tokens, cached, finish, headers)


def complete(client: OpenAI, prompt: Sequence[int], *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> Answer:
    """/v1/completions with a token-id prompt; streaming answers are joined chunk by chunk."""
    raw = client.completions.with_raw_response.create(prompt=list(prompt), **_request(stream, max_tokens))
    return _answer(raw, stream, lambda c: c.text, lambda c: (_token_ids(c), c.text))


@dataclass(frozen=True)
class Ranked:
    """A greedy answer with, at each position, the top candidates' logprobs by token id."""

    token_ids: tuple[int, ...]
    top: tuple[dict[int, float], ...]


def ranked(client: OpenAI, prompt: Sequence[int], *, max_tokens: int, candidates: int = 2) -> Ranked:
    """/v1/completions, not streamed, with the top `candidates` logprobs keyed by token id
    (`return_tokens_as_token_ids`: token texts of a random model collide)."""
    resp = client.completions.create(
        model=MODEL_NAME,
        prompt=list(prompt),
        max_tokens=max_tokens,
        temperature=0,
        logprobs=candidates,
        extra_body={**_EXTRA, "return_tokens_as_token_ids": True},
    )
    choice = resp.choices[0]
    if choice.logprobs is None or choice.logprobs.top_logprobs is None:
        raise AssertionError(f"the response carries no top logprobs: {choice!r}")
    top = tuple(
        {int(k.removeprefix("token_id:")): float(v) for k, v in (pos or {}).items()}
        for pos in choice.logprobs.top_logprobs
    )
    return Ranked(tuple(_token_ids(choice)), top)


def _chat_piece(choice: Any) -> tuple[list[int], str]:
    extra = choice.model_extra or {}
    return list(extra.get("token_ids") or ()), choice.delta.content or ""


def chat(
    client: OpenAI, messages: list[dict[str, str]], *, stream: bool = False, max_tokens: int = MAX_TOKENS
) -> Answer:
    """/v1/chat/completions; streaming answers are joined chunk by chunk."""
    raw = client.chat.completions.with_raw_response.create(
        messages=messages,  # type: ignore[arg-type]
        **_request(stream, max_tokens),
    )
    return _answer(raw, stream, lambda c: c.message.content or "", _chat_piece)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page as (name, labels, value)."""
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        text = client.get(base_url + "/metrics").raise_for_status().text
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` (optionally matching `labels`)."""
    want = labels or {}
    found = [v for n, lab, v in scrape(base_url) if n == name and all(lab.get(k) == x for k, x in want.items())]
    if not found:
        raise AssertionError(f"{base_url}/metrics has no sample {name}{labels or ''}")
    return sum(found)


def engine_counters(base_url: str) -> dict[str, float]:
    """What a vLLM engine says about KV: connector counters, prompt tokens by source, usage, finishes.

    Keys: the connector's counter names (`blocks_pulled`, ...), `tokens_<source>` for vLLM's
    prompt_tokens_by_source, `finished_<reason>` (vLLM counts no client abort there), `kv_usage`,
    `running`, `generated` (tokens generated).
    """
    out: dict[str, float] = {}
    for name, labels, value in scrape(base_url):
        key = None
        if name.startswith("pdgate_connector_") and name.endswith("_total"):
            key = name[len("pdgate_connector_") : -len("_total")]
        elif name == "vllm:prompt_tokens_by_source_total":
            key = "tokens_" + labels.get("source", "?")
        elif name == "vllm:request_success_total":
            key = "finished_" + labels.get("finished_reason", "?")
        elif name == "vllm:kv_cache_usage_perc":
            key = "kv_usage"
        elif name == "vllm:num_requests_running":
            key = "running"
        elif name == "vllm:generation_tokens_total":
            key = "generated"
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


class Engine(Protocol):
    """An engine to observe: a LocalStack InstanceHandle, or one found in a launcher's run dir."""

    @property
    def url(self) -> str: ...

    def read_stats(self) -> dict[str, Any]: ...


def observe(instance: Engine) -> dict[str, float]:
    """`engine_counters` of an engine of the stack, with the connector's counters taken from its stats
    file (written by the connector's own thread, so it is current even while the engine is idle and
    has no step to report increments to vLLM on), plus `holding` and `receiving`."""
    out = engine_counters(instance.url)
    stats = instance.read_stats()
    for name, value in stats.get("counters", {}).items():
        out[name] = float(value)
    for name in ("holding", "receiving"):
        if name in stats:
            out[name] = float(stats[name])
    return out


def settled(instance: Engine, *, quiet_s: float = 0.6, timeout: float = 30.0) -> dict[str, float]:
    """`observe()` once the engine's numbers have stopped moving: two reads `quiet_s` apart agree.

    Why: the connector's stats file is written by its control process, coalesced to a few writes a
    second, so a read taken right after the answers may be a step behind; a baseline taken too early
    would make every later delta wrong. Use it for baselines and for the final reads of a test.
    """
    deadline = time.monotonic() + timeout
    last = observe(instance)
    while True:
        time.sleep(quiet_s)
        now = observe(instance)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}


def get_handoff(metaserver_url: str, transfer_id: str, token: str | None = None) -> Handoff:
    """The ledger record of one request (the router answers with its transfer id as X-Request-Id);
    `token`: the metaserver's admin token (reads of the ledger need it)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        resp = client.get(f"{metaserver_url}/v1/handoffs/{transfer_id}", headers=headers)
    if resp.status_code != 200:
        raise AssertionError(f"GET /v1/handoffs/{transfer_id} answered {resp.status_code}: {resp.text}")
    return Handoff.model_validate(resp.json())


def live_handoffs(metaserver_url: str, token: str | None = None) -> list[dict[str, Any]]:
    """The ledger's live handoffs (PENDING, READY, CLAIMED), as `pdgate handoffs` lists them; `token`: the
    metaserver's admin token."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        resp = client.get(f"{metaserver_url}/v1/handoffs", params={"limit": 1000}, headers=headers)
    if resp.status_code != 200:
        raise AssertionError(f"GET /v1/handoffs answered {resp.status_code}: {resp.text}")
    found: list[dict[str, Any]] = resp.json()["handoffs"]
    return found


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll until `check()` holds; fail naming `what` (a deadline for the test, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}")
        time.sleep(interval)

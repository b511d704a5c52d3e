"""pdgate PD is a drop-in for `vllm serve` (issue 15): the same requests, the same answers.

A table of requests over the fields that change an answer's shape is sent to the single vLLM instance
(the baseline, no connector) and to the 1P1D stack through the router. For each, the tokens are equal
(greedy, or seeded sampling) and the answers have the same shape: the same keys at every level, the same
list lengths, the same JSON types. Values that differ by nature are masked (ids, timestamps) and so are
the fields PD adds or sets (`kv_transfer_params`; `usage.prompt_tokens_details.cached_tokens`, which
must instead count the transferred prompt). Logprobs are compared token by token, values to within a
rounding of the bfloat16 KV.

Then vLLM's other routes through the router against the instance's own, what PD refuses (a typed 400
naming the field, before any engine work), and `vllm bench serve` through the router on a small random
dataset: no warning about a missing route, its result JSON kept under bench/results/.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdgate.deploy.local.stack import LocalStack
from pdgate.deploy.local.tiny_model import MODEL_NAME
from pdgate.deploy.local.vllm_env import VllmEnv

from tests.e2e.conftest import Baseline
from tests.e2e.pdclient import metric, prompt_ids

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MODEL_LEN = 4096  # --max-model-len of both
MASKED = {"id", "created", "system_fingerprint", "kv_transfer_params"}
LOGPROB_TOL = 0.05
_HTTP = httpx.Client(timeout=300)

P = prompt_ids(40, seed=1500)
P2 = prompt_ids(70, seed=1501)
P3 = prompt_ids(33, seed=1502)
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about the river"}]
TOKENS = {"return_token_ids": True, "ignore_eos": True}

# (name, route, body): every body is sent as is to both sides.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("greedy", "completions", {"prompt": P, "max_tokens": 8, "temperature": 0}),
    ("seeded-sampling", "completions", {"prompt": P, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7}),
    ("logprobs", "completions", {"prompt": P2, "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    ("echo", "completions", {"prompt": P3, "max_tokens": 5, "temperature": 0, "echo": True}),
    ("echo-logprobs", "completions", {"prompt": P3, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2}),
    ("prompt-logprobs", "completions", {"prompt": P2, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}),
    ("several-prompts", "completions", {"prompt": [P, P2, P3], "max_tokens": 5, "temperature": 0}),
    (
        "clamped-to-max-model-len",
        "completions",
        {"prompt": prompt_ids(MODEL_LEN - 6, 1503), "max_tokens": 50, "temperature": 0},
    ),
    (
        "stream-usage",
        "completions",
        {"prompt": P, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}},
    ),
    (
        "stream-continuous-usage",
        "completions",
        {
            "prompt": P2,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "stream-several-prompts",
        "completions",
        {"prompt": [P3, P], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("chat", "chat", {"messages": MSGS, "max_tokens": 8, "temperature": 0}),
    (
        "chat-top-logprobs",
        "chat",
        {"messages": MSGS, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ),
    ("chat-prompt-logprobs", "chat", {"messages": MSGS, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}),
    (
        "chat-stream-usage",
        "chat",
        {"messages": MSGS, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}},
    ),
    # n samples: one prefill; the decode's n sibling requests share its KV
    ("n-seeded", "completions", {"prompt": P, "max_tokens": 6, "n": 3, "temperature": 0.9, "seed": 3}),
    ("n-several-prompts", "completions", {"prompt": [P3, P2], "max_tokens": 4, "n": 2, "temperature": 0.7, "seed": 9}),
    (
        "chat-n-seeded-stream",
        "chat",
        {"messages": MSGS, "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 5, "stream": True},
    ),
]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def ask(base: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON answer) or, for a stream, (status, list of event objects without [DONE]). Greedy
    unless the body samples with a seed: vLLM's unseeded sampling draws from the engine's generator."""
    full = {"model": MODEL_NAME, "temperature": 0, **TOKENS, **body}
    if not body.get("stream"):
        r = _HTTP.post(base + PATHS[route], json=full)
        return r.status_code, r.json()
    with _HTTP.stream("POST", base + PATHS[route], json=full) as r:
        raw = b"".join(r.iter_bytes())
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    return r.status_code, [json.loads(e) for e in events[:-1]]


def shape(value: Any) -> Any:
    """Keys at every level, list lengths and JSON types, masked fields left out."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items()) if k not in MASKED}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    return "number"


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path (list items merged as `[]`), masked fields left out."""
    if isinstance(value, dict):
        out = {prefix}
        for k, v in value.items():
            if k not in MASKED:
                out |= key_paths(v, f"{prefix}.{k}")
        return out
    if isinstance(value, list):
        return set().union({prefix}, *(key_paths(v, prefix + "[]") for v in value))
    return {prefix}


def tokens(answer: Any, route: str) -> list[Any]:
    """Per choice index: the output token ids and text (whole answers), or their concatenation (streams)."""
    out: dict[int, list[Any]] = {}
    chunks = answer if isinstance(answer, list) else [answer]
    for chunk in chunks:
        for c in chunk.get("choices") or []:
            got = out.setdefault(c["index"], [[], ""])
            got[0] += c.get("token_ids") or []
            if route == "chat":
                got[1] += (c.get("message") or c.get("delta") or {}).get("content") or ""
            else:
                got[1] += c.get("text") or ""
    return [out[i] for i in sorted(out)]


def close_logprobs(a: Any, b: Any, path: str = "") -> None:
    """The same structure, the same tokens, numbers within LOGPROB_TOL."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            close_logprobs(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close_logprobs(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(a, bool):
        assert math.isclose(a, b, abs_tol=LOGPROB_TOL) or (math.isinf(a) and a == b), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def logprob_parts(answer: dict[str, Any]) -> Any:
    """Every logprobs field of a whole answer (the stream cases ask for none)."""
    parts = [answer.get("prompt_logprobs")]
    for c in answer.get("choices") or []:
        parts.append((c.get("logprobs"), c.get("prompt_logprobs")))
    return parts


@pytest.mark.parametrize(("name", "route", "body"), CASES, ids=[c[0] for c in CASES])
def test_same_answer_as_vllm(
    name: str, route: str, body: dict[str, Any], pd_stack: LocalStack, baseline: Baseline
) -> None:
    baseline._ready()
    want_status, want = ask(baseline.instance.url, route, body)
    got_status, got = ask(pd_stack.url, route, body)
    assert got_status == want_status == 200, (got, want)
    assert tokens(got, route) == tokens(want, route), f"{name}: PD tokens differ from vLLM's"
    if isinstance(want, list):
        # A stream: the same keys at every level, over all its events. vLLM puts the tokens that are
        # ready when the client is written to into one event, so how many events there are, and which
        # one is both first and last (a null finish_reason or not), depends on timing.
        assert key_paths(got) == key_paths(want)
    else:
        assert shape(got) == shape(want)
        close_logprobs(logprob_parts(got), logprob_parts(want))
    usage = (got[-1] if isinstance(got, list) else got).get("usage")
    if usage is not None and "prompt_tokens_details" in usage and usage["prompt_tokens_details"]:
        # every prompt token's KV came from the prefill (fresh prompts; usage sums over prompts)
        details = usage["prompt_tokens_details"]
        if name == "echo-logprobs":  # vLLM serves it with prompt logprobs: the decode recomputes the prompt
            assert details["cached_tokens"] == 0, name
        else:
            assert details["cached_tokens"] == usage["prompt_tokens"], name


@pytest.mark.parametrize(
    ("field", "body"), [("use_beam_search", {"use_beam_search": True}), ("best_of", {"best_of": 2})]
)
def test_what_pd_cannot_serve_is_a_400_naming_the_field(field: str, body: dict[str, Any], pd_stack: LocalStack) -> None:
    status, answer = ask(pd_stack.url, "completions", {"prompt": P, "max_tokens": 4, **body})
    assert status == 400 and answer["error"]["param"] == field and answer["error"]["code"] == "pd_unsupported_parameter"


def test_past_max_model_len_is_refused_like_vllm_before_the_prefill(pd_stack: LocalStack, baseline: Baseline) -> None:
    baseline._ready()
    body = {"prompt": P, "max_tokens": MODEL_LEN + 1}
    want_status, want = ask(baseline.instance.url, "completions", body)
    before = _prefills(pd_stack)
    got_status, got = ask(pd_stack.url, "completions", body)
    assert want_status == got_status == 400
    assert got["error"]["param"] == want["error"]["param"] == "max_tokens"
    assert got["error"]["code"] == "context_length_exceeded"
    assert _prefills(pd_stack) == before, "no prefill ran"


def test_greedy_n_is_refused_as_vllm_refuses_it(pd_stack: LocalStack, baseline: Baseline) -> None:
    baseline._ready()
    body = {"prompt": P, "max_tokens": 4, "n": 2}
    want_status, want = ask(baseline.instance.url, "completions", body)
    got_status, got = ask(pd_stack.url, "completions", body)
    assert want_status == got_status == 400 and got["error"]["message"] == want["error"]["message"]


def _prefills(stack: LocalStack) -> float:
    """Prompt tokens the prefills have processed (vLLM's own counter, present from start-up)."""
    return sum(metric(i.url, "vllm:prompt_tokens_total") for i in stack.instances if i.role == "prefill")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"prompt": "hello river mountain", "add_special_tokens": False}),
        ("POST", "/tokenize", {"messages": MSGS, "add_generation_prompt": True}),
        ("POST", "/detokenize", {"tokens": [5, 6, 7, 8]}),
    ],
)
def test_vllms_other_routes_answer_as_the_instance_does(
    method: str, path: str, body: dict[str, Any] | None, pd_stack: LocalStack, baseline: Baseline
) -> None:
    baseline._ready()
    payload = {"model": MODEL_NAME, **body} if body is not None else None
    want = _HTTP.request(method, baseline.instance.url + path, json=payload)
    got = _HTTP.request(method, pd_stack.url + path, json=payload)
    assert got.status_code == want.status_code == 200
    assert got.json() == want.json()


def test_models_have_vllms_card(pd_stack: LocalStack, baseline: Baseline) -> None:
    baseline._ready()
    want = _HTTP.get(baseline.instance.url + "/v1/models").json()["data"]
    got = _HTTP.get(pd_stack.url + "/v1/models").json()["data"]
    assert shape(got) == shape(want) and got[0]["max_model_len"] == want[0]["max_model_len"] == MODEL_LEN


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_a_route_no_instance_serves_is_a_typed_404(path: str, pd_stack: LocalStack) -> None:
    r = _HTTP.post(pd_stack.url + path, json={"model": MODEL_NAME, "input": "hello"})
    assert r.status_code == 404 and r.headers["x-pdgate-error"] == "not_found"
    assert r.json()["error"]["code"] == "not_found"


def test_vllm_bench_serve_through_the_router(
    pd_stack: LocalStack, vllm_env: VllmEnv, model_dir: Path, tmp_path: Path
) -> None:
    """`vllm bench serve` (the vllm CLI, run as the README says) on a small random dataset: every request
    succeeds and no route is missing. Its result JSON goes to the test's own folder: a test run leaves the
    checkout as it found it (this one rewrote a tracked bench/results file on every CI run)."""
    results = tmp_path
    name = "vllm-bench-serve-pd.json"
    cmd = [
        str(vllm_env.python),
        "-m",
        "pdgate.deploy.local.vllm_cli",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        pd_stack.url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        "8",
        "--num-prompts",
        "24",
        "--max-concurrency",
        "4",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(results),
        "--result-filename",
        name,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "unavailable" not in log and "skipping alignment" not in log, log[-4000:]
    result = json.loads((results / name).read_text())
    assert result["completed"] == 24 and result.get("failed", 0) == 0, result
    print(f"vllm bench serve through pdgate: {result['request_throughput']:.2f} req/s", file=sys.stderr)

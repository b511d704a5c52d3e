"""The router as a drop-in for `vllm serve` (issue 15), over sockets to pdgate-sim engines.

What PD cannot serve is refused before any engine work, naming the field; several prompts fan out to one
PD pair each and come back merged in order (whole and streamed); the usage counts the transferred prompt
as cached; `/v1/models` gives the engines' own cards (`max_model_len`); vLLM's other routes reach an
instance or get a typed 404; unknown routes answer in the OpenAI shape. The real-vLLM side of the same
contract is tests/e2e/test_drop_in.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.router.conftest import HTTP, Deployment, Sim, transfer_ids
from tests.support.ports import free_port

MODEL_LEN = 512  # the sims' --max-model-len


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    with Deployment(prefill_policy="round_robin", decode_policy="round_robin", api_key=["sk-test"]) as d:
        args = ("--max-model-len", str(MODEL_LEN))
        d.add_many([("prefill", args), ("prefill", args), ("decode", args)])
        d.wait_available(*(s.id for s in d.sims))
        yield d


@pytest.fixture(autouse=True)
def clean(dep: Deployment) -> None:
    for sim in dep.sims:
        sim.reset()


def client(dep: Deployment) -> openai.OpenAI:
    return dep.openai(api_key="sk-test")


def engine_requests(dep: Deployment) -> int:
    return sum(s.count("requests") for s in dep.sims)


def prefilled(dep: Deployment) -> list[str]:
    return [t for s in dep.sims if s.role == "prefill" for t in transfer_ids(s, "prefill")]


def decoded(dep: Deployment) -> list[str]:
    return [t for s in dep.sims if s.role == "decode" for t in transfer_ids(s, "decode")]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"n": 2, "temperature": 0}, "n"),  # vLLM's own rule (greedy sampling has one answer), checked first
    ],
)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_what_pd_cannot_serve_is_a_typed_400_before_any_engine_work(
    dep: Deployment, extra: dict[str, object], param: str, route: str
) -> None:
    c = client(dep)
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=extra
            )
        else:
            c.completions.create(model="sim-model", prompt="hi", max_tokens=3, extra_body=extra)
    err = info.value
    code = "invalid_request" if param == "n" else "pd_unsupported_parameter"
    assert err.status_code == 400 and err.code == code and err.param == param
    assert err.response.headers["x-pdgate-error"] == code
    assert param in err.message or "greedy" in err.message
    assert engine_requests(dep) == 0


def test_best_of_one_and_n_one_pass(dep: Deployment) -> None:
    got = client(dep).completions.create(model="sim-model", prompt="hi", max_tokens=2, n=1, extra_body={"best_of": 1})
    assert len(got.choices) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "short", "max_tokens": MODEL_LEN + 1}, "max_tokens"),
        ({"prompt": list(range(MODEL_LEN + 1)), "max_tokens": 1}, "prompt"),
        ({"prompt": [[1, 2], list(range(MODEL_LEN + 5))], "max_tokens": 1}, "prompt"),
    ],
)
def test_past_max_model_len_is_refused_before_the_prefill(dep: Deployment, body: dict[str, object], param: str) -> None:
    r = HTTP.post(
        dep.url + "/v1/completions",
        json={"model": "sim-model", **body},
        headers={"authorization": "Bearer sk-test"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param and str(MODEL_LEN) in err["message"]
    assert r.headers["x-pdgate-error"] == "context_length_exceeded"
    assert engine_requests(dep) == 0


def test_chat_max_completion_tokens_is_the_field_named(dep: Deployment) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(dep).chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=MODEL_LEN + 1
        )
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_completion_tokens"
    assert engine_requests(dep) == 0


def test_several_prompts_fan_out_and_merge_in_order(dep: Deployment) -> None:
    c = client(dep)
    prompts = ["alpha beta", "gamma delta epsilon", "zeta"]
    alone = [c.completions.create(model="sim-model", prompt=p, max_tokens=4) for p in prompts]
    for sim in dep.sims:
        sim.reset()
    merged = c.completions.create(model="sim-model", prompt=prompts, max_tokens=4)
    assert [ch.index for ch in merged.choices] == [0, 1, 2]
    assert [ch.text for ch in merged.choices] == [a.choices[0].text for a in alone]
    assert merged.usage is not None
    assert merged.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert merged.usage.completion_tokens == 12
    p, d = prefilled(dep), decoded(dep)
    assert len(p) == 3 and sorted(p) == sorted(d), "each prompt has its own prefill and decode"


def test_several_prompts_stream_merged_with_one_usage_and_one_done(dep: Deployment) -> None:
    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    c = client(dep)
    alone = [c.completions.create(model="sim-model", prompt=p, max_tokens=3).choices[0].text for p in prompts]
    with HTTP.stream(
        "POST",
        dep.url + "/v1/completions",
        json={
            "model": "sim-model",
            "prompt": prompts,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"authorization": "Bearer sk-test"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events.count(b"[DONE]") == 1 and events[-1] == b"[DONE]"
    chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
    assert len({ch["id"] for ch in chunks}) == 1, "one id for the whole answer"
    texts = ["", "", ""]
    for ch in chunks[:-1]:
        for choice in ch["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == alone
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 9
    assert usage["usage"]["completion_tokens"] == 9 and usage["usage"]["total_tokens"] == 18
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 9


def test_one_prompt_refused_refuses_the_request(dep: Deployment) -> None:
    """The prefill sims refuse 400 (their own max_model_len counts words): the client gets that answer."""
    long_text = "word " * (MODEL_LEN + 10)
    r = HTTP.post(
        dep.url + "/v1/completions",
        json={"model": "sim-model", "prompt": ["fine", long_text], "max_tokens": 2},
        headers={"authorization": "Bearer sk-test"},
    )
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_usage_counts_the_transferred_prompt_as_cached(dep: Deployment) -> None:
    c = client(dep)
    got = c.completions.create(model="sim-model", prompt="one two three four five", max_tokens=2)
    assert got.usage is not None and got.usage.prompt_tokens == 5
    assert got.usage.prompt_tokens_details is not None and got.usage.prompt_tokens_details.cached_tokens == 5
    chunks = list(
        c.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "six seven"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens > 0


def test_models_carry_the_engines_cards(dep: Deployment) -> None:
    models = client(dep).models.list().data
    assert [m.id for m in models] == ["sim-model"]
    card = models[0].model_dump()
    assert card["max_model_len"] == MODEL_LEN and card["owned_by"] == "pdgate-sim"


@pytest.mark.parametrize(("method", "path"), [("POST", "/tokenize"), ("POST", "/v1/embeddings")])
def test_a_vllm_route_no_instance_serves_is_a_typed_404(dep: Deployment, method: str, path: str) -> None:
    auth = {"authorization": "Bearer sk-test"}
    body = {"model": "sim-model", "prompt": "hi"} if method == "POST" else None
    r = HTTP.request(method, dep.url + path, json=body, headers=auth)
    assert r.status_code == 404 and r.headers["x-pdgate-error"] == "not_found"
    assert r.json()["error"]["code"] == "not_found" and path in r.json()["error"]["message"]
    assert HTTP.request(method, dep.url + path, json=body).status_code == 401, "same keys as the OpenAI routes"
    other = "GET" if method == "POST" else "POST"
    assert HTTP.request(other, dep.url + path, headers=auth).status_code == 405


def test_a_passed_through_route_for_an_unknown_model_is_model_not_found(dep: Deployment) -> None:
    r = HTTP.post(
        dep.url + "/tokenize", json={"model": "nope", "prompt": "x"}, headers={"authorization": "Bearer sk-test"}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/completions/", "/tokenize/extra"])
def test_unknown_routes_answer_in_the_openai_shape(dep: Deployment, path: str) -> None:
    r = HTTP.get(dep.url + path)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert r.json()["error"]["code"] == "not_found" and r.json()["error"]["type"] == "invalid_request_error"


def test_decode_is_not_asked_for_prompt_logprobs(dep: Deployment) -> None:
    c = client(dep)
    c.completions.create(model="sim-model", prompt="hello there", max_tokens=2, extra_body={"prompt_logprobs": 1})
    (p_sim,) = [s for s in dep.sims if s.role == "prefill" and s.count("prefill")]
    (d_sim,) = [s for s in dep.sims if s.role == "decode"]
    p_body = next(e["body"] for e in p_sim.stats(log=True)["log"] if e["mode"] == "prefill")
    d_body = next(e["body"] for e in d_sim.stats(log=True)["log"] if e["mode"] == "decode")
    assert p_body["prompt_logprobs"] == 1 and "prompt_logprobs" not in d_body


def test_a_passed_through_route_skips_an_instance_that_cannot_be_reached() -> None:
    """One dead instance of the model: it is skipped (503 pd_no_instance when it is the only one); next to a
    live one that does not serve the route, the answer is the typed 404."""
    dead = f"http://127.0.0.1:{free_port()}"
    with Deployment(prefill=[dead], decode=[dead], model="sim-model") as alone:
        r = HTTP.post(alone.url + "/tokenize", json={"model": "sim-model", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "pd_no_instance"
        assert r.headers["x-pdgate-error"] == "pd_no_instance"
    live = Sim("both").wait()
    try:
        with Deployment(prefill=[dead, live.url], decode=[live.url], model="sim-model") as both:
            r = HTTP.post(both.url + "/tokenize", json={"model": "sim-model", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    finally:
        live.stop()

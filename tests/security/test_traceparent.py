"""Only a well-formed W3C trace context reaches the engines (issue #21, finding 2).

Before, `traceparent` and `tracestate` went to the prefill and the decode unchecked: `garbage; rm -rf /`,
a 4 MB value and 500 copies of the header all reached the prefill (and with fan-out, one 1 MB header
became about 128 MB sent to the engines). Now a malformed or repeated `traceparent` is dropped with its
`tracestate`, an over-long or malformed `tracestate` is dropped alone, each drop is counted in
`pdgate_router_trace_context_dropped_total`, and the engines start a new trace. What the engine got is
read off the wire by a relay in front of a pdgate-sim process.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.router.conftest import Deployment
from tests.security.engine_log import EngineLog
from tests.support.ports import wait_until

PARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = b"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
CHAT = b"/v1/chat/completions"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Deployment, EngineLog]]:
    with EngineLog("both") as engine, Deployment(prefill=[engine.url], decode=[engine.url]) as d:
        wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="the static engine")
        yield d, engine


def _chat(d: Deployment, headers: list[tuple[bytes, bytes]]) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(d.url + CHAT.decode(), json=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text


def _dropped(d: Deployment) -> float:
    text = httpx.get(d.url + "/metrics", timeout=5).text
    found = re.search(r"^pdgate_router_trace_context_dropped_total (\S+)$", text, re.M)
    assert found, "the router exports no trace_context_dropped counter"
    return float(found.group(1))


def _sent(d: Deployment, engine: EngineLog, headers: list[tuple[bytes, bytes]]) -> list[list[bytes]]:
    before = len(engine.posts(CHAT))
    _chat(d, headers)
    wait_until(lambda: len(engine.posts(CHAT)) >= before + 2, timeout=10, what="prefill and decode recorded")
    return [[*s.values(b"traceparent"), *s.values(b"tracestate")] for s in engine.posts(CHAT)[before:]]


def test_a_well_formed_context_reaches_prefill_and_decode_unchanged(served: tuple[Deployment, EngineLog]) -> None:
    d, engine = served
    before = _dropped(d)
    got = _sent(d, engine, [(b"traceparent", PARENT), (b"tracestate", STATE)])
    assert got == [[PARENT, STATE], [PARENT, STATE]]
    assert _dropped(d) == before


@pytest.mark.parametrize(
    "headers",
    [
        [(b"traceparent", b"garbage; rm -rf /")],
        [(b"traceparent", PARENT.upper())],  # the spec's hex is lowercase
        [(b"traceparent", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01")],  # all-zero trace id
        [(b"traceparent", b"ff" + PARENT[2:])],  # version ff is invalid
        [(b"traceparent", PARENT + b"-" + b"x" * 30_000)],
        [(b"traceparent", PARENT)] * 500,
        [(b"traceparent", b"nonsense"), (b"tracestate", STATE)],  # a tracestate without a valid parent
    ],
    ids=["garbage", "uppercase", "zero-trace", "version-ff", "long", "500-copies", "state-orphan"],
)
def test_a_malformed_traceparent_is_dropped_and_counted(
    served: tuple[Deployment, EngineLog], headers: list[tuple[bytes, bytes]]
) -> None:
    d, engine = served
    before = _dropped(d)
    assert _sent(d, engine, headers) == [[], []]
    assert _dropped(d) == before + 1


@pytest.mark.parametrize(
    "state",
    [
        b",".join(b"k%d=v" % i for i in range(33)),  # 33 list members
        b"k=" + b"v" * 250 + b",j=" + b"v" * 250 + b",i=vvvvvvvvvvvvv",  # over 512 characters
        b"Bad Key=1",
        b"a=1,a=2",  # a key twice
    ],
    ids=["33-members", "over-512", "bad-key", "repeated-key"],
)
def test_a_bad_tracestate_is_dropped_and_the_parent_kept(served: tuple[Deployment, EngineLog], state: bytes) -> None:
    d, engine = served
    before = _dropped(d)
    assert _sent(d, engine, [(b"traceparent", PARENT), (b"tracestate", state)]) == [[PARENT], [PARENT]]
    assert _dropped(d) == before + 1


def test_passthrough_routes_forward_only_a_valid_context(served: tuple[Deployment, EngineLog]) -> None:
    d, engine = served
    before = _dropped(d)
    for parent in (b"garbage; rm -rf /", PARENT):
        count = len(engine.posts(b"/tokenize"))
        resp = httpx.post(
            d.url + "/tokenize", json={"prompt": "hi"}, headers=[(b"traceparent", parent)] * 2, timeout=10
        )
        assert resp.status_code == 404  # pdgate-sim serves no /tokenize: it is asked, and says so
        wait_until(lambda: len(engine.posts(b"/tokenize")) > count, timeout=10, what="the /tokenize recorded")  # noqa: B023
        assert engine.posts(b"/tokenize")[-1].values(b"traceparent") == []  # repeated: dropped either way
    ok = httpx.post(d.url + "/tokenize", json={"prompt": "hi"}, headers={"traceparent": PARENT.decode()}, timeout=10)
    assert ok.status_code == 404
    wait_until(lambda: engine.posts(b"/tokenize")[-1].values(b"traceparent") == [PARENT], timeout=10, what="kept")
    assert _dropped(d) == before + 2

"""A decode vLLM dies under load (SIGKILL) in a real 1P2D stack: nothing untyped, nothing held.

The chaos suite (bench/chaos.py) measures faults against simulated engines; this is the same fault on
real vLLM engines with the real connector: the engine process and its EngineCore are killed mid-stream.
What must hold:
- every one of 8 concurrent streaming clients gets either its full answer or a typed error (an HTTP
  error or an SSE error event with a pdgate code), never a truncated answer or a bare reset;
- the prefill's KV usage returns to idle within the handoff lease (its held blocks are freed: DONE for
  the answered requests, abort or expiry for the ones the dead decode took with it);
- the next 8 requests are answered in full by the surviving decode.
The stack is the fault tests' own (`conftest.FaultStack`: it ends with a dead engine; test_11 gets a
fresh decode in its place). Three engines
on a 2-core host run unpinned (pdgate-local's placement): pinned round robin, decode-1 shared the prefill's
core and got no CPU at all while the prefill held KV, so its loads failed before any fault (docs/NIXL.md).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from pdgate.deploy.local.stack import LocalStack
from pdgate.deploy.local.tiny_model import MODEL_NAME

from pdgate.errors import Code
from tests.e2e.conftest import FaultStack
from tests.e2e.pdclient import observe, openai_client, prompt_ids, wait_for

pytestmark = pytest.mark.e2e

CODES = {c.value for c in Code}
LONG = 1200  # tokens per stream: long enough to be in flight when the decode dies
READY_LEASE_S = 30.0  # the embedded metaserver's default READY lease


def _log(msg: str) -> None:
    print(f"[e2e faults] {msg}", flush=True)


@pytest.fixture(scope="module")
def stack_1p2d(fault_stack: FaultStack) -> LocalStack:
    return fault_stack.get()


def _idle(counters: dict[str, float]) -> bool:
    return counters.get("holding", 0) == 0 and counters["kv_usage"] == 0.0 and counters["running"] == 0


def _stream(client: openai.OpenAI, seed: int, max_tokens: int) -> dict[str, Any]:
    """One streaming request, classified: ok (all tokens, a finish_reason), typed, or untyped."""
    n, finish, usage = 0, None, None
    try:
        resp = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt_ids(120, seed=seed),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in resp:
            for c in chunk.choices:
                n += 1 if c.text else 0
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
    except openai.APIStatusError as exc:
        code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
        return {"kind": "typed" if code in CODES else "untyped", "code": code, "detail": str(exc)[:200]}
    except openai.APIConnectionError as exc:
        return {"kind": "untyped", "code": None, "detail": f"connection: {exc!r}"[:200]}
    except openai.APIError as exc:  # an SSE error event
        code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
        return {"kind": "typed" if code in CODES else "untyped", "code": code, "detail": str(exc)[:200]}
    tokens = usage.completion_tokens if usage is not None else 0
    if finish is None or tokens != max_tokens:
        detail = f"truncated: {tokens} tokens in {n} chunks, finish_reason {finish}"
        return {"kind": "untyped", "code": None, "detail": detail}
    return {"kind": "ok", "code": None, "detail": ""}


def test_sigkill_decode_under_load(stack_1p2d: LocalStack) -> None:
    stack = stack_1p2d
    [prefill] = stack.by_role("prefill")
    decodes = stack.by_role("decode")
    wait_for(lambda: all(_idle(observe(e)) for e in [prefill, *decodes]), timeout=60, what="an idle stack")
    client = openai_client(stack.openai_base_url, timeout=240)

    # Without a fault first: 8 concurrent requests over both decodes. A failure here is the data path of
    # 1P2D itself, not the fault below.
    with ThreadPoolExecutor(max_workers=8) as pool:
        warm = list(pool.map(lambda i: _stream(client, 700 + i, 16), range(8)))
    assert [r["kind"] for r in warm] == ["ok"] * 8, f"1P2D without any fault: {warm}"
    wait_for(lambda: all(_idle(observe(e)) for e in [prefill, *decodes]), timeout=60, what="idle after warm-up")

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(_stream, client, 800 + i, LONG) for i in range(8)]
        # Kill a decode while it is generating for some of the clients.
        # The kill follows the very read that saw the victim busy: a second read taken after a pause
        # once found the streams already finished (CI, stop 18), and a kill of an idle decode proves
        # nothing about in-flight streams.
        deadline = time.monotonic() + 120
        victim, running_at_kill = None, 0.0
        while time.monotonic() < deadline:
            running = [(observe(d)["running"], d) for d in decodes]
            busy = [(n, d) for n, d in running if n > 0]
            if len(busy) == len(decodes) or (busy and time.monotonic() > deadline - 100):
                running_at_kill, victim = max(busy, key=lambda nd: nd[0])
                victim.proc.signal_group(signal.SIGKILL)  # the API server and its EngineCore, at once
                break
            time.sleep(0.05)
        assert victim is not None, "no decode ever had a request running"
        _log(f"killed {victim.instance_id} with {running_at_kill:.0f} requests running")
        results = [f.result(timeout=300) for f in futures]

    untyped = [r for r in results if r["kind"] == "untyped"]
    assert not untyped, results
    assert running_at_kill > 0
    # The kill landed on streams in flight; the router resumes them on the survivor (router/resume.py,
    # issue #24): every client gets its full answer (tests/e2e/test_11_resume.py checks the tokens).
    assert all(r["kind"] == "ok" for r in results), results
    _log(f"outcomes: {[r['kind'] + (':' + r['code'] if r['code'] else '') for r in results]}")

    # Every block the prefill held is freed within the handoff lease (plus a sweep and a feed round).
    wait_for(lambda: _idle(observe(prefill)), timeout=READY_LEASE_S + 15, what="the prefill's KV usage back to idle")

    survivor = next(d for d in decodes if d is not victim)
    before = observe(survivor).get("finished_length", 0.0)
    with ThreadPoolExecutor(max_workers=8) as pool:
        after = list(pool.map(lambda i: _stream(client, 900 + i, 16), range(8)))
    assert [r["kind"] for r in after] == ["ok"] * 8, after
    assert observe(survivor).get("finished_length", 0.0) - before == 8

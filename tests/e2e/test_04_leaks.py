"""Nothing leaks: after the requests the ledger holds no live record, the prefill holds no blocks
and its KV usage is back to idle; a client that hangs up mid-stream makes decode abort.

Waits poll with generous deadlines: the assertions are about the end state and about *why* blocks
were freed (DONE, or an abort), never about how fast.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from openai import OpenAI
from pdgate.deploy.local.stack import LocalStack
from pdgate.deploy.local.tiny_model import MODEL_NAME

from pdgate.models import HandoffState
from tests.e2e.pdclient import (
    Answer,
    chat,
    chat_messages,
    complete,
    delta,
    get_handoff,
    observe,
    prompt_ids,
    settled,
    wait_for,
)

pytestmark = pytest.mark.e2e


def _idle(counters: dict[str, float]) -> bool:
    return counters.get("holding", 0) == 0 and counters["kv_usage"] == 0.0 and counters["running"] == 0


def test_no_ledger_record_or_block_is_held_after_requests(pd_stack: LocalStack, router_client: OpenAI) -> None:
    [prefill] = pd_stack.by_role("prefill")
    [decode] = pd_stack.by_role("decode")
    wait_for(lambda: _idle(observe(prefill)) and _idle(observe(decode)), timeout=60, what="an idle stack to start")
    p0 = settled(prefill)

    def send(i: int) -> Answer:
        if i % 3 == 2:
            return chat(router_client, chat_messages(50, seed=500 + i), stream=bool(i % 2))
        return complete(router_client, prompt_ids(100 + 150 * i, seed=500 + i), stream=bool(i % 2))

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(send, range(6)))

    tids = [a.headers["x-request-id"] for a in answers]
    meta = pd_stack.metaserver_url
    wait_for(
        lambda: all(get_handoff(meta, t, pd_stack.admin_token).state.terminal for t in tids),
        timeout=60,
        what="every handoff to end",
    )
    states = {t: get_handoff(meta, t, pd_stack.admin_token).state for t in tids}
    assert all(s is HandoffState.DONE for s in states.values()), states
    # The prefill frees each request's blocks once its handoff is DONE: back to the idle usage.
    wait_for(lambda: _idle(observe(prefill)), timeout=60, what="the prefill to free every held block")
    wait_for(lambda: _idle(observe(decode)), timeout=60, what="the decode to go idle")
    p = delta(settled(prefill), p0)
    assert p["sends_held"] == len(tids), p
    assert p["sends_freed_done"] == len(tids), p
    assert p["sends_freed_expired"] == 0 and p["sends_freed_local_deadline"] == 0, p


def test_client_disconnect_mid_stream_aborts_decode_and_frees_blocks(pd_stack: LocalStack) -> None:
    [prefill] = pd_stack.by_role("prefill")
    [decode] = pd_stack.by_role("decode")
    wait_for(lambda: _idle(observe(prefill)) and _idle(observe(decode)), timeout=60, what="an idle stack to start")
    d0, p0 = settled(decode), settled(prefill)
    body = {
        "model": MODEL_NAME,
        "prompt": prompt_ids(200, seed=600),
        "max_tokens": 3500,  # far more than is read: decode would run for seconds unless aborted
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    with (
        httpx.Client(timeout=120, trust_env=False) as client,
        client.stream(
            "POST",
            pd_stack.url + "/v1/completions",
            content=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status_code == 200
        tid = resp.headers["x-request-id"]
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
            if chunks >= 3:
                break  # hang up: leaving the block closes the connection mid-stream
    assert chunks == 3
    wait_for(lambda: observe(decode)["running"] == 0, timeout=60, what="decode to stop the abandoned request")
    d = delta(settled(decode), d0)
    # Stopped early: it neither ran to max_tokens nor finished any other way; the router aborted it.
    assert d["finished_length"] == 0 and d["finished_stop"] == 0, d
    # The first of the three chunks is the prefill's token (router/first_token.py): the decode made the rest.
    assert 2 <= d["generated"] < body["max_tokens"], f"decode did not abort the request: {d}"
    wait_for(lambda: _idle(observe(prefill)) and _idle(observe(decode)), timeout=60, what="every block freed")
    assert get_handoff(pd_stack.metaserver_url, tid, pd_stack.admin_token).state.terminal
    p = delta(settled(prefill), p0)
    assert p["sends_held"] == 1 and p["sends_freed_done"] + p["sends_freed_aborted"] == 1, p

"""A prefill's bad answer is the prefill's failure, never the client's (issue #21, finding 5).

Real parts: a router over real sockets (`Deployment`, static instances, its embedded metaserver), fake
engines on real sockets (`hostile_engine`: a prefill that lies in its answer, an honest one, a decode
that keeps what it was sent) and the official `openai` client. Before the fix, a prefill answering
`kv_key: "NaN"` reached the decode, whose 400 was relayed to the client as its own error, with no retry
and no breaker verdict; with the first token from the prefill on, token ids no tokenizer has were
streamed to the client before anything refused them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import openai
import pytest

from pdgate.urls import static_instance_id
from tests.integration.router.conftest import Deployment
from tests.integration.router.test_router_bad_answers import Engine, Script
from tests.integration.router.test_router_bad_answers import router as pd_router
from tests.security.hostile_engine import MODEL, Decode, Lie, prefill

TOKEN = "prefill-blame-admin-token"


def _kv(**fields: Any) -> Lie:
    return lambda answer: answer["kv_transfer_params"].update(fields)


def _choice(**fields: Any) -> Lie:
    return lambda answer: answer["choices"][0].update(fields)


BAD_PARAMS: dict[str, Lie] = {
    "kv_key NaN": _kv(kv_key="NaN"),
    "kv_key not the handoff's": lambda a: a["kv_transfer_params"].update(kv_key=a["kv_transfer_params"]["kv_key"] + 1),
    "remote_num_tokens negative": _kv(remote_num_tokens=-1),
    "block ids not ints": _kv(remote_block_ids=[["x"]]),
    "transfer_id not an id": _kv(transfer_id="../../etc"),
    "params not an object": lambda a: a.update(kv_transfer_params=[1, 2]),
}

BAD_FIRST_TOKENS: dict[str, Lie] = {
    "negative token id": _choice(token_ids=[-5]),
    "token id 2**63-1": _choice(token_ids=[2**63 - 1]),
    "token id a float": _choice(token_ids=[1.5]),
    "mixed-type prompt ids": _choice(prompt_token_ids=[104, "i", 33]),
    "prompt id out of range": _choice(prompt_token_ids=[-1, 105]),
    "text not a string": _choice(text=["x"]),
}


router = partial(pd_router, admin_token=TOKEN)  # scripted engines, the PD path alone


def breakers(d: Deployment) -> dict[str, str]:
    import httpx

    rows = httpx.get(d.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()["instances"]
    return {i["id"]: i["breaker"] for i in rows}


@pytest.mark.parametrize("how", list(BAD_PARAMS))
def test_bad_kv_params_are_the_prefills_failure_retried_elsewhere(
    engines: Callable[[Script], Engine], how: str
) -> None:
    bad, good, dec = engines(prefill(TOKEN, BAD_PARAMS[how])), engines(prefill(TOKEN)), Decode()
    with router([bad, good], [engines(dec)], breaker_failures=3) as r:
        client = r.openai()
        for _ in range(8):  # round robin: the bad prefill is tried first until its breaker opens
            assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].text == " ok"
        assert breakers(r)[static_instance_id(bad.url)] == "open"
    assert bad.completions == 3 and good.completions == 8
    assert len(dec.bodies) == 8  # the decode never got the bad answer's params


@pytest.mark.parametrize("how", list(BAD_PARAMS))
def test_a_lone_bad_prefill_is_a_typed_502_not_the_clients_400(engines: Callable[[Script], Engine], how: str) -> None:
    dec = Decode()
    with router([engines(prefill(TOKEN, BAD_PARAMS[how]))], [engines(dec)], breaker_failures=1000) as r:
        with pytest.raises(openai.APIStatusError) as info:
            r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert info.value.status_code == 502 and info.value.code == "pd_prefill_failed"
        with pytest.raises(openai.APIStatusError) as info:  # a stream: refused before it starts
            list(r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
        assert info.value.status_code == 502 and info.value.code == "pd_prefill_failed"
    assert dec.bodies == []


@pytest.mark.parametrize("how", list(BAD_FIRST_TOKENS))
def test_a_bad_first_token_never_reaches_the_client(engines: Callable[[Script], Engine], how: str) -> None:
    """First token from the prefill on (the default): the ids are checked before a byte goes out; the
    bad prefill is retried elsewhere, and alone it is a typed 502 before any token."""
    bad, good, dec = engines(prefill(TOKEN, BAD_FIRST_TOKENS[how])), engines(prefill(TOKEN)), Decode()
    with router([bad, good], [engines(dec)], breaker_failures=1000) as r:
        for _ in range(4):
            stream = r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == " fine ok"
    assert bad.completions >= 2 and good.completions == 4
    assert all(b["prompt"] == [104, 105, 1000] for b in dec.bodies)  # only the honest prefill's first token
    lone = Decode()
    with router([engines(prefill(TOKEN, BAD_FIRST_TOKENS[how]))], [engines(lone)], breaker_failures=1000) as r:
        got: list[str] = []
        with pytest.raises(openai.APIStatusError) as info:
            for chunk in r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True):
                got.append(chunk.choices[0].text)
        assert info.value.status_code == 502 and info.value.code == "pd_prefill_failed" and got == []
    assert lone.bodies == []

"""What the router takes from a prefill's answer on trust, and what it checks (issue #21, finding 6).

Real parts: a router over real sockets (`Deployment`, static instances, its embedded metaserver with an
admin token, so claims are sealed), fake engines on real sockets (`hostile_engine`) and the official
`openai` client. Before the fix, a prefill that answered other prompt ids made the decode answer
another prompt with 200, and the router sealed whatever `remote_location` the prefill named (here the
cloud metadata address), which a decode then pulls from without asking the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import openai
import pytest

from pdgate.claim_seal import claim_key
from pdgate.contract import KVTransferParams
from pdgate.models import KVLocation
from pdgate.urls import static_instance_id
from tests.integration.router.test_router_bad_answers import Engine, Script
from tests.integration.router.test_router_bad_answers import router as pd_router
from tests.security.hostile_engine import FIRST_ID, LOCATION, MODEL, Decode, prefill

TOKEN = "first-token-trust-admin-token"
METADATA = "169.254.169.254"


router = partial(pd_router, admin_token=TOKEN)  # scripted engines, the PD path alone


def other_prompt(answer: dict[str, Any]) -> None:
    answer["choices"][0]["prompt_token_ids"] = [7, 7, 7]


def test_a_prefill_cannot_swap_a_token_id_prompt(engines: Callable[[Script], Engine]) -> None:
    """The client sent token ids: the prefill's prompt ids must be those, or the decode would continue
    another prompt. Refused as the prefill's failure before any token; retried on an honest prefill."""
    dec = Decode()
    with router([engines(prefill(TOKEN, other_prompt))], [engines(dec)]) as r:
        with pytest.raises(openai.APIStatusError) as info:
            list(r.openai().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True))
        assert info.value.status_code == 502 and info.value.code == "pd_prefill_failed"
    assert dec.bodies == []
    dec = Decode()
    with router([engines(prefill(TOKEN, other_prompt)), engines(prefill(TOKEN))], [engines(dec)]) as r:
        for _ in range(2):
            stream = r.openai().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == " fine ok"
    assert [b["prompt"] for b in dec.bodies] == [[1, 2, 3, FIRST_ID]] * 2


def test_a_text_prompt_keeps_the_prefills_tokenization(engines: Callable[[Script], Engine]) -> None:
    """The client sent text: the router cannot check the prefill's tokenization and trusts it (SECURITY.md),
    so the decode continues the prefill's prompt ids."""
    dec = Decode()
    with router([engines(prefill(TOKEN, other_prompt))], [engines(dec)]) as r:
        stream = r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == " fine ok"
    assert [b["prompt"] for b in dec.bodies] == [[7, 7, 7, FIRST_ID]]


def metadata_location(answer: dict[str, Any]) -> None:
    answer["kv_transfer_params"]["remote_location"] = {
        **LOCATION,
        "host": METADATA,
        "transport_addresses": [{"tp_rank": 0, "host": METADATA, "port": 80}],
    }


@pytest.mark.parametrize("stream", [False, True])
def test_the_router_seals_only_the_ledgers_location(engines: Callable[[Script], Engine], stream: bool) -> None:
    """The prefill names the cloud metadata address as its KV's location; the ledger's READY record says
    otherwise. The decode gets, under a seal it can verify, the ledger's location only."""
    dec = Decode()
    d = engines(dec)
    with router([engines(prefill(TOKEN, metadata_location))], [d]) as r:
        if stream:
            out = r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
            assert "".join(c.choices[0].text for c in out if c.choices) == " fine ok"
        else:
            assert r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text == " ok"
    [body] = dec.bodies
    kv = KVTransferParams.parse(body["kv_transfer_params"])
    assert METADATA not in str(body["kv_transfer_params"])
    assert kv.location() == KVLocation.model_validate(LOCATION)
    assert kv.trusted_until(static_instance_id(d.url), claim_key(TOKEN)) is not None  # sealed over that location

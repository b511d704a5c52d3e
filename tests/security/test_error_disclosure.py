"""Client-facing errors name a role and an opaque name, never an engine's address nor its own words
(issue #21, finding 10). The details go to the router's log and to the admin's `/health`.

Real parts: a router over real sockets (`Deployment`, static instances whose ids are `<host>-<port>`,
an admin token), fake engines on real sockets (`hostile_engine`, `test_router_bad_answers.Engine`) and
the official `openai` client. Before the fix a client read "127.0.0.1-18102 has its circuit breaker
open" and the engine's error body.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from pdgate.urls import static_instance_id
from tests.integration.router.conftest import Deployment
from tests.integration.router.test_router_bad_answers import Engine, Script, head
from tests.integration.router.test_router_bad_answers import router as pd_router
from tests.security.hostile_engine import MODEL, Decode, prefill
from tests.support.ports import wait_until

TOKEN = "error-disclosure-admin-token"
SECRET = "engine-internal 10.9.8.7:5555 stack trace"  # what a failing engine says about itself
OPAQUE = re.compile(r"(prefill|decode) (#[0-9a-f]{10})")


def failing(req: dict[str, Any]) -> bytes:
    body = SECRET.encode()
    return head("503 Service Unavailable", "content-type: text/plain", f"content-length: {len(body)}") + body


router = partial(pd_router, admin_token=TOKEN)  # scripted engines, the PD path alone


def admin_names(d: Deployment) -> dict[str, str]:
    """Opaque name -> instance id, as the admin's /health pairs them."""
    rows = httpx.get(d.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()["instances"]
    return {i["public_id"]: i["id"] for i in rows}


def hidden(message: str, *engines: Engine) -> bool:
    """Nothing in `message` names an engine: no id, no port, none of its words."""
    return SECRET not in message and all(
        static_instance_id(e.url) not in message and e.url.rsplit(":", 1)[1] not in message for e in engines
    )


def test_an_engine_failure_names_the_role_and_an_opaque_name(
    engines: Callable[[Script], Engine], caplog: pytest.LogCaptureFixture
) -> None:
    p, d = engines(prefill(TOKEN)), engines(failing)
    with router([p], [d], breaker_failures=1000) as r:
        with caplog.at_level(logging.WARNING), pytest.raises(openai.APIStatusError) as info:
            r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=1)
        err = info.value
        assert err.status_code == 502 and err.code == "pd_decode_failed" and "answered 503" in err.message
        assert hidden(err.message, p, d), err.message
        found = OPAQUE.search(err.message)
        assert found is not None and found[1] == "decode"
        assert admin_names(r)[found[2]] == static_instance_id(d.url)  # the admin maps the name back
    logged = caplog.text
    assert static_instance_id(d.url) in logged and SECRET in logged  # the details are in the log


def test_an_open_breaker_is_reported_without_the_address(engines: Callable[[Script], Engine]) -> None:
    p, d = engines(failing), engines(Decode())
    with router([p], [d], breaker_failures=1, breaker_open_s=60, on_ledger_outage="refuse") as r:  # no pair: refused
        client = r.openai()
        with pytest.raises(openai.APIStatusError) as first:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert first.value.code == "pd_prefill_failed" and hidden(first.value.message, p, d)
        with pytest.raises(openai.APIStatusError) as then:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        err = then.value
        assert err.status_code == 503 and err.code == "pd_no_compatible_pair"
        assert "has its circuit breaker open" in err.message and hidden(err.message, p, d), err.message
        found = OPAQUE.search(err.message)
        assert found is not None and admin_names(r)[found[2]] == static_instance_id(p.url)
        anonymous = httpx.get(r.url + "/health", timeout=5).text  # the open /health: same names, no address
        assert hidden(anonymous, p, d) and found[2] in anonymous


def test_a_wrong_metaserver_token_is_a_configuration_error_not_an_outage(engines: Callable[[Script], Engine]) -> None:
    """A router whose metaserver token is wrong answered 503 pd_metaserver_unavailable, retryable, as if the
    metaserver were down; it is a distinct code, not retried, and /health says it is the configuration."""
    p, d = engines(prefill(TOKEN)), engines(Decode())
    with Deployment(admin_token=TOKEN) as metaserver:  # a router's embedded metaserver, used as a separate one
        with Deployment(
            metaserver=metaserver.url, metaserver_token="not-the-token", prefill=[p.url], decode=[d.url], model=MODEL
        ) as r:
            wait_until(lambda: r.health()["models"] == [MODEL], timeout=20, what="the static pair")
            with pytest.raises(openai.APIStatusError) as info:
                r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=1)
            err = info.value
            assert err.status_code == 503 and err.code == "pd_metaserver_misconfigured", err.message
            assert "configuration error" in err.message and err.response.headers.get("retry-after") is None
            got = httpx.get(r.url + "/health", timeout=5)
            assert got.status_code == 503 and "configuration error" in got.json()["reason"], got.json()
    assert p.completions == 0 and d.completions == 0  # no handoff: no engine was asked


def test_routers_holding_one_admin_token_name_an_instance_alike(engines: Callable[[Script], Engine]) -> None:
    """An opaque name read in one router's error maps back through any replica's (or worker's) admin view."""
    p, d = engines(prefill(TOKEN)), engines(Decode())
    with router([p], [d]) as one, router([p], [d]) as two:
        assert admin_names(one) == admin_names(two)
        assert set(admin_names(one).values()) == {static_instance_id(p.url), static_instance_id(d.url)}

"""A metaserver that refuses the router's own ledger calls (400 or 422) is a configuration error, not an
outage (issue #21, "errors that mislead operators").

Before, every `MetaError` from the metaserver client became a retryable 503 `pd_metaserver_unavailable`:
a router and a metaserver that disagree on the contract (another version, a proxy in between that
rewrites bodies) read as the metaserver being down, and the router retried. With that mapping put back,
this test's request even got 200: the router took the refusal for an outage and served it whole
(`on_ledger_outage="serve-whole"`, the default), so the mismatch went unseen. `test_error_disclosure`
covers the wrong token (401); here the token is right and the metaserver refuses the request itself.

Real parts: a router over real sockets (`Deployment`, static instances) whose metaserver is a relay on
a real socket in front of a real one (another router's embedded metaserver, as the 401 case uses): it
forwards every call but answers the creation of a handoff (single or batch) with an RFC 7807 problem,
as a metaserver that reads the router's bodies differently would. The engines are fake (`hostile_engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.integration.router.conftest import Deployment
from tests.integration.router.test_router_bad_answers import Engine, Script
from tests.security.hostile_engine import MODEL, Decode, prefill
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread, receive_body

TOKEN = "metaserver-refusal-admin-token"
_CREATES = ("/v1/handoffs", "/v1/handoffs/batch")


class RefusingMetaserver:
    """ASGI relay: every call goes to `upstream` except a handoff's creation, answered with `status`."""

    def __init__(self, upstream: str, status: int) -> None:
        self.upstream = upstream
        self.status = status
        self.refused = 0  # creations refused: one per attempt the router made

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = await receive_body(receive)
        if scope["method"] == "POST" and scope["path"] in _CREATES:
            self.refused += 1
            problem = {"type": "about:blank", "title": "refused", "status": self.status, "code": "invalid_request"}
            problem["detail"] = "body does not match this metaserver's schema: field 'kv_key' unexpected"
            await _answer(send, self.status, orjson.dumps(problem), b"application/problem+json")
            return
        headers = [
            (k.decode(), v.decode()) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")
        ]
        query = scope["query_string"].decode()
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        async with httpx.AsyncClient(timeout=60) as client:
            got = await client.request(scope["method"], url, content=body, headers=headers)
        await _answer(send, got.status_code, got.content, got.headers.get("content-type", "").encode())


async def _answer(send: Any, status: int, body: bytes, ctype: bytes) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def refusing() -> Iterator[Callable[[int], tuple[RefusingMetaserver, str]]]:
    """Factory: a real metaserver behind a relay that refuses creations with the given status."""
    with contextlib.ExitStack() as stack:

        def make(status: int) -> tuple[RefusingMetaserver, str]:
            real = stack.enter_context(Deployment(admin_token=TOKEN))  # a router's embedded metaserver
            relay = RefusingMetaserver(real.url, status)
            return relay, stack.enter_context(UvicornThread(relay)).url

        yield make


@pytest.mark.parametrize("status", [400, 422])
def test_a_metaserver_refusing_the_routers_request_is_a_configuration_error(
    status: int, engines: Callable[[Script], Engine], refusing: Callable[[int], tuple[RefusingMetaserver, str]]
) -> None:
    relay, url = refusing(status)
    p, d = engines(prefill(TOKEN)), engines(Decode())
    with Deployment(metaserver=url, metaserver_token=TOKEN, prefill=[p.url], decode=[d.url], model=MODEL) as r:
        wait_until(lambda: r.health()["models"] == [MODEL], timeout=20, what="the static pair")
        with pytest.raises(openai.APIStatusError) as info:
            r.openai().completions.create(model=MODEL, prompt="hi", max_tokens=1)
        err = info.value
        assert err.code == "pd_metaserver_misconfigured", (err.status_code, err.code, err.message)
        assert err.status_code == 503 and "configuration error" in err.message
        assert err.response.headers.get("retry-after") is None  # not an outage to wait out
        assert relay.refused == 1  # not retried: the same body would be refused again
    assert p.completions == 0 and d.completions == 0  # no handoff: no engine was asked

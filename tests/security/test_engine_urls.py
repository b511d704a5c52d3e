"""Point: an instance URL is validated at registration (422 naming `body.url`), optionally against
`--allowed-engine-networks`. Stored, each of these URLs would fail only later, when the router probes
or dials it (a port of 99999 stops a health loop that gathers every instance at once)."""

from __future__ import annotations

import httpx
import pytest

from tests.security.conftest import Serve, registration

BAD = [
    "http://127.0.0.1:99999",
    "http://",
    "http://[::1",
    "http://user:pw@host/x?y=",
    "http://10.0.0.5:0",
    "http://10.0.0.5:8100/v1",
    "http://10.0.0.5:8100?x=1",
    "http://10.0.0.5:8100#frag",
    "http://fd00::5:8100",
    "http://bad_host:8100",
    "ftp://10.0.0.5:21",
    "http://10.0.0.5:8100\r\nX-Evil: 1",
]


@pytest.mark.parametrize("url", BAD)
async def test_bad_engine_url_is_refused_naming_the_field(serve: Serve, url: str) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        resp = await http.post("/v1/instances", json=registration(url=url))
        assert resp.status_code == 422, (url, resp.text)
        assert resp.json()["code"] == "validation_error" and "body.url" in resp.json()["detail"]
        assert (await http.get("/v1/instances")).json() == {"instances": []}


async def test_good_engine_urls_are_kept_without_trailing_slash(serve: Serve) -> None:
    base = serve().url
    async with httpx.AsyncClient(base_url=base) as http:
        for i, url in enumerate(["http://10.0.0.5:8100/", "https://[fd00::5]:8443", "http://engine-0.pd.svc:8000"]):
            resp = await http.post("/v1/instances", json=registration(f"p{i}", url=url))
            assert resp.status_code == 200, resp.text
            assert resp.json()["instance"]["url"] == url.rstrip("/")


async def test_allowed_engine_networks(serve: Serve) -> None:
    base = serve(allowed_engine_networks="10.0.0.0/8, fd00::/8").url
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/v1/instances", json=registration("a", url="http://10.1.2.3:8000"))).status_code == 200
        assert (await http.post("/v1/instances", json=registration("b", url="http://[fd00::9]:80"))).status_code == 200
        for url in ("http://192.168.1.5:8000", "http://169.254.169.254:80", "http://engine.example:8000"):
            resp = await http.post("/v1/instances", json=registration("c", url=url))
            assert resp.status_code == 422 and "body.url" in resp.json()["detail"], resp.text


def test_malformed_network_list_is_refused_at_start_up() -> None:
    from pdgate.metaserver.settings import MetaSettings

    with pytest.raises(ValueError, match="not a CIDR"):
        MetaSettings(allowed_engine_networks="10.0.0.0/8,ten-net")

"""The router's status page (`GET /status`) loaded in headless Chromium against a running router and
pdgate-sim engines: the numbers it shows are those of /metrics, the admin token shows what the admin
/health shows and nothing of it leaks without, and a screenshot of it is kept under the test's tmp_path.

Chromium is Debian's `chromium` package (deploy/test.sh installs it); it is driven through its own
command line (`--dump-dom`, `--screenshot`), with a virtual time budget so the page's script has run its
first poll of /status/data before the DOM is read.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdgate.histo import quantile
from tests.integration.router.conftest import HTTP, Deployment
from tests.support.ports import wait_until

TOKEN = "status-page-admin-token-42"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"


def chromium(*args: str) -> str:
    """Run headless Chromium; its stdout."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is missing: deploy/test.sh installs Debian's chromium package")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=2500", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


class Page(HTMLParser):
    """The loaded DOM: text by element id, cells by data attribute, the pool's rows."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.cells: dict[tuple[str, str], str] = {}  # (attribute, value) -> text
        self.pool_rows: list[list[str]] = []
        self._open: list[tuple[str | None, tuple[str, str] | None]] = []
        self._in_pool = False
        self.text = ""
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if a.get("id") == "pool":
            self._in_pool = True
        if self._in_pool and tag == "tr":
            self.pool_rows.append([])
        key = next(((k, a[k]) for k in ("data-code", "data-state", "data-col") if k in a), None)
        self._open.append((a.get("id"), key))

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_pool = False
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        self.text += data
        for ident, key in self._open:
            if ident:
                self.by_id[ident] = self.by_id.get(ident, "") + data
            if key:
                self.cells[key] = self.cells.get(key, "") + data
        if self._in_pool and self.pool_rows and self._open and self._open[-1][1] is not None:
            self.pool_rows[-1].append(data)


def metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(HTTP.get(url + "/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def ms(text: str) -> float:
    assert text.endswith(" ms"), text
    return float(text[:-3])


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    with Deployment(admin_token=TOKEN) as d:
        p, dd = d.add_many([("prefill", ()), ("decode", ("--token-delay", "0.005"))])
        d.wait_available(p.id, dd.id)
        client = d.openai()
        for _ in range(4):
            for _chunk in client.completions.create(model="sim-model", prompt="hi", max_tokens=6, stream=True):
                pass
            client.completions.create(model="sim-model", prompt="hi", max_tokens=3)
        with pytest.raises(Exception, match="does not exist"):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        yield d


def test_the_page_shows_the_numbers_of_metrics(dep: Deployment, tmp_path: Path) -> None:
    m = metrics(dep.url)
    page = Page(chromium("--dump-dom", f"{dep.url}/status#token={TOKEN}"))
    assert page.by_id["status"] == "ok"
    assert page.by_id["view"] == "admin view"
    assert float(page.by_id["total-requests"]) == sum(v for _, v in m["pdgate_router_requests_total"]) == 9
    [(_, ttft_count)] = m["pdgate_router_ttft_seconds_count"]
    assert float(page.by_id["ttft-count"]) == ttft_count == 8  # the 200 answers; the 404 is no first token
    [(_, tpot_count)] = m["pdgate_router_tpot_seconds_count"]
    assert tpot_count == 4  # one per stream
    for name, ident in (("ttft", "ttft-p50"), ("tpot", "tpot-p95")):
        buckets = sorted((float(lb["le"]), v) for lb, v in m[f"pdgate_router_{name}_seconds_bucket"])
        q = 0.5 if ident.endswith("50") else 0.95
        expected = quantile(q, buckets)
        assert expected is not None
        assert ms(page.by_id[ident]) == pytest.approx(expected * 1000, abs=0.01 if expected < 0.01 else 0.5)
    # The decode writes a token every 5 ms or slower: no TPOT can read less than the bucket below 5 ms.
    assert ms(page.by_id["tpot-p50"]) >= 2.5
    errors = {lb["code"]: v for lb, v in m["pdgate_router_errors_total"]}
    assert float(page.cells[("data-code", "model_not_found")]) == errors["model_not_found"] == 1
    for sim in dep.sims:
        assert sim.url in page.text and sim.id in page.text
    assert {page.cells[("data-state", s)] for s in ("PENDING", "READY", "CLAIMED")} == {"0"}
    shot = tmp_path / "status.png"
    chromium("--window-size=1400,1000", f"--screenshot={shot}", f"{dep.url}/status#token={TOKEN}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"status page screenshot: {shot}")


def test_without_the_token_the_page_shows_no_address(dep: Deployment) -> None:
    page = Page(chromium("--dump-dom", f"{dep.url}/"))
    assert page.by_id["view"].startswith("public view")
    assert float(page.by_id["total-requests"]) == 9
    for sim in dep.sims:
        assert sim.url not in page.text and sim.id not in page.text
    public = {i["public_id"] for i in dep.health()["instances"]}
    assert {row[0] for row in page.pool_rows if row} == public


def test_the_data_follows_the_health_rule_and_counts_live_handoffs(dep: Deployment) -> None:
    anon = HTTP.get(dep.url + "/status/data").json()
    admin = HTTP.get(dep.url + "/status/data", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert not anon["admin"] and admin["admin"]
    assert all("url" not in r and "load" not in r for r in anon["instances"])
    assert {r["url"] for r in admin["instances"]} == {s.url for s in dep.sims}
    assert HTTP.get(dep.url + "/status/data", headers={"Authorization": "Bearer wrong"}).json()["admin"] is False
    page = HTTP.get(dep.url + "/")
    assert page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    # A decode that waits before it claims: the handoff stays live (READY, or CLAIMED when the router
    # claims for it), and the page counts it.
    decode = dep.by_role("decode")[0]
    decode.script(decode_delay=3.0)
    try:
        done = threading.Thread(
            target=lambda: dep.openai().completions.create(model="sim-model", prompt="wait", max_tokens=1)
        )
        done.start()
        wait_until(
            lambda: sum(HTTP.get(dep.url + "/status/data").json()["handoffs"].values()) == 1,
            timeout=10,
            what="the live handoff on the status page",
        )
        done.join(timeout=30)
    finally:
        decode.script(decode_delay=0.0)


def test_an_engines_own_words_are_shown_as_text() -> None:
    """A model name is what an engine registered: the page shows it as text, never as markup."""
    name = '<b id="injected">x</b>'
    with Deployment(admin_token=TOKEN) as d:
        [sim] = d.add_many([("decode", ("--model", name))])
        d.wait_available(sim.id)
        page = Page(chromium("--dump-dom", f"{d.url}/status#token={TOKEN}"))
    assert "injected" not in page.by_id
    assert name in page.text


def test_handoffs_from_a_remote_metaserver() -> None:
    """With --metaserver, the live handoffs come from the metaserver's /metrics (read with its token)."""
    from tests.cli.conftest import TOKEN as META_TOKEN
    from tests.cli.conftest import metaserver

    meta = metaserver()
    try:
        auth = {"Authorization": f"Bearer {META_TOKEN}"}
        for i in range(2):
            body = {"prefill_instance_id": "p-remote", "transfer_id": f"remote-{i}"}
            assert HTTP.post(meta.url + "/v1/handoffs", json=body, headers=auth).status_code == 201
        want = {"PENDING": 2, "READY": 0, "CLAIMED": 0}
        with Deployment(metaserver=meta.url, metaserver_token=META_TOKEN, admin_token=META_TOKEN) as d:
            # The page's counts are the last reading of the metaserver's gauges, which its sweeper refreshes:
            # on a loaded host the first reading may predate them (CI saw all zeros once).
            wait_until(lambda: HTTP.get(d.url + "/status/data").json()["handoffs"] == want, timeout=20,
                       what="the remote metaserver's two PENDING handoffs on the page")  # fmt: skip
    finally:
        meta.stop()

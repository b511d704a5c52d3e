"""The server's fast lane (router/fastlane.py) answers exactly as uvicorn's ASGI cycle does.

Two routers with the same settings in front of the same 1 prefill + 1 decode sims (static instances, each
router's own embedded ledger): one served with the fast lane (as `pdgate-router` serves), one without it.
Every exchange goes to both, over real sockets (the official `openai` client, or raw bytes for the edge
cases), and the answers must match; a protocol subclass records which requests took the lane, so each
test also shows that the lane, not the fallback, answered (or that the fallback did, for the shapes the
lane leaves to uvicorn).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from pdgate.router.app import serving_protocol
from pdgate.router.fastlane import LaneCycle
from pdgate.router.routes import lane_routes
from starlette.routing import Match

from tests.integration.router.conftest import HTTP, Deployment, Sim, start_sims
from tests.support.ports import wait_until
from tests.support.servers import UvicornThread

KEY = "lane-key"
TOKEN = "lane-admin-token"
AUTH = f"authorization: Bearer {KEY}\r\n"
LIMIT_S = 1.5  # header and body timeouts: short, so the slow-client cases end quickly
MAX_BODY = 64 * 1024


def recording(base: type[Any]) -> type[Any]:
    """`base` (the router's protocol) noting, per request, (method, path, whether the lane took it)."""

    class Recording(base):  # type: ignore[misc, valid-type]
        seen: list[tuple[str, str, bool]] = []

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:
                self.seen.append((self.scope["method"], self.scope["path"], type(cycle) is LaneCycle))

    return Recording


class Router:
    """A static-mode router (embedded ledger) in front of `sims`, with or without the fast lane."""

    def __init__(self, sims: list[Sim], lane: bool) -> None:
        self.sims = sims
        self.dep = Deployment(
            prefill=[s.url for s in sims if s.role == "prefill"],
            decode=[s.url for s in sims if s.role == "decode"],
            api_key=[KEY],
            admin_token=TOKEN,
            header_timeout_s=LIMIT_S,
            body_timeout_s=LIMIT_S,
            max_body_bytes=MAX_BODY,
        )
        self.protocol = recording(serving_protocol(self.dep.settings, fast_lane=lane))
        self.dep.server = UvicornThread(self.dep.app, port=self.dep.settings.port, http=self.protocol)
        self.url = self.dep.url
        self.port = self.dep.settings.port

    @property
    def seen(self) -> list[tuple[str, str, bool]]:
        return list(self.protocol.seen)

    def laned(self, method: str, path: str) -> int:
        return sum(1 for m, p, lane in self.protocol.seen if (m, p, lane) == (method, path, True))

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Router, Router]]:
    sims = start_sims([("prefill", ["--admin-token", TOKEN]), ("decode", ["--admin-token", TOKEN])])
    lane, asgi = Router(sims, lane=True), Router(sims, lane=False)
    try:
        for r in (lane, asgi):
            r.dep.start()
            r.dep.wait_available(*(s.id for s in sims))
        yield lane, asgi
    finally:
        lane.dep.stop()
        asgi.dep.stop()
        for s in sims:
            s.stop()


# -- raw HTTP/1.1 on a socket --------------------------------------------------------------------


def connect(router: Router) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.settimeout(10)
    return sock


def post(path: str, body: bytes, *, headers: str = AUTH, length: bool = True) -> bytes:
    size = f"content-length: {len(body)}\r\n" if length else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n{size}{headers}\r\n".encode() + body
    )


def completion(prompt: str = "hello lane", **extra: Any) -> bytes:
    return orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 3, **extra})


class Reader:
    """Reads HTTP/1.1 answers off one socket (Content-Length or chunked bodies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise EOFError(f"closed before {marker!r}: {self.buf[:300]!r}")
        out, self.buf = self.buf.split(marker, 1)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError("closed mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        head = self._until(b"\r\n\r\n").decode()
        status_line, *lines = head.split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._until(b"\r\n"), 16):
                body += self._exactly(size)
                self._exactly(2)
            self._exactly(2)
        else:
            body = self._exactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, body

    def closed(self) -> bool:
        """True once the server closed the connection (after anything still buffered)."""
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return True


VARIABLE = {"date", "x-request-id", "content-length"}  # differ per request, not per server


def same(a: tuple[int, dict[str, str], bytes], b: tuple[int, dict[str, str], bytes]) -> None:
    """Two answers match: status, headers (but the date and request id), and body (but ids and times)."""
    assert a[0] == b[0], (a, b)
    assert {k: v for k, v in a[1].items() if k not in VARIABLE} == {k: v for k, v in b[1].items() if k not in VARIABLE}
    assert normal(a[2]) == normal(b[2])


def normal(body: bytes) -> Any:
    if body.startswith(b"data: "):  # a stream: each event without its ids
        return [normal(e.removeprefix(b"data: ")) for e in body.split(b"\n\n")]
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if isinstance(doc, dict):
        for k in ("id", "created"):
            doc.pop(k, None)
    return doc


def both(pair: tuple[Router, Router], raw: bytes, answers: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `raw` to each router on a fresh connection, read `answers` answers from each, check they match."""
    got = []
    for r in pair:
        with connect(r) as sock:
            sock.sendall(raw)
            reader = Reader(sock)
            got.append([reader.answer() for _ in range(answers)])
    for a, b in zip(*got, strict=True):
        same(a, b)
    return got[0]


# -- the tests -----------------------------------------------------------------------------------


def test_openai_client_gets_the_same_answers_through_the_lane(pair: tuple[Router, Router]) -> None:
    lane, asgi = pair
    before = lane.laned("POST", "/v1/completions"), lane.laned("POST", "/v1/chat/completions")
    ledger_before = sum(1 for m, p, on in lane.seen if p.startswith("/v1/handoffs") and on)
    out = []
    for r in (lane, asgi):
        c = r.openai()
        text = c.completions.create(model="sim-model", prompt="the quick brown fox", max_tokens=5)
        msgs: Any = [{"role": "user", "content": "hello there"}]
        chat = c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4)
        stream = c.completions.create(
            model="sim-model", prompt="stream me", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        out.append(
            (
                text.choices[0].text,
                text.usage,
                chat.choices[0].message.content,
                chat.usage,
                "".join(ch.choices[0].text for ch in chunks if ch.choices),
                chunks[-1].usage,
            )
        )
    assert out[0] == out[1]
    assert len(out[0][4].split()) == 6 and out[0][5] is not None and out[0][5].completion_tokens == 6
    assert lane.laned("POST", "/v1/completions") == before[0] + 2
    assert lane.laned("POST", "/v1/chat/completions") == before[1] + 1
    # The sims' READY (PUT) and DONE calls to the embedded ledger took the lane too.
    assert sum(1 for m, p, on in lane.seen if p.startswith("/v1/handoffs") and on) >= ledger_before + 6
    assert not any(on for _, _, on in asgi.seen)


def test_typed_errors_match_bad_json_missing_key_unknown_model(pair: tuple[Router, Router]) -> None:
    lane, _ = pair
    before = lane.laned("POST", "/v1/completions")
    bad_json = both(pair, post("/v1/completions", b'{"model": "sim-model", "prompt": '))[0]
    assert bad_json[0] == 400 and orjson.loads(bad_json[2])["error"]["type"] == "invalid_request_error"
    no_key = both(pair, post("/v1/completions", completion(), headers=""))[0]
    assert no_key[0] == 401 and orjson.loads(no_key[2])["error"]["code"] == "invalid_api_key"
    unknown = both(pair, post("/v1/completions", completion(model="nope")))[0]
    assert unknown[0] == 404 and orjson.loads(unknown[2])["error"]["code"] == "model_not_found"
    empty = both(pair, post("/v1/chat/completions", b""))[0]
    assert empty[0] == 400
    assert lane.laned("POST", "/v1/completions") == before + 3


def test_an_oversized_body_gets_the_openai_shaped_413_before_it_is_read(pair: tuple[Router, Router]) -> None:
    head = post("/v1/completions", b"")  # the head only: the declared length is over the limit
    head = head.replace(b"content-length: 0", f"content-length: {MAX_BODY + 1}".encode())
    status, headers, body = both(pair, head)[0]
    assert status == 413 and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "body_too_large"


def test_pipelined_requests_are_answered_in_order(pair: tuple[Router, Router]) -> None:
    lane, _ = pair
    before = lane.laned("POST", "/v1/completions")
    raw = post("/v1/completions", completion("first", max_tokens=2)) + post("/v1/completions", b"{not json")
    raw += post("/v1/completions", completion("third", max_tokens=4))
    first, second, third = both(pair, raw, answers=3)
    assert first[0] == 200 and len(orjson.loads(first[2])["choices"][0]["text"].split()) == 2
    assert second[0] == 400
    assert third[0] == 200 and len(orjson.loads(third[2])["choices"][0]["text"].split()) == 4
    # The first took the lane; those behind it wait on uvicorn's own pipeline queue.
    assert lane.laned("POST", "/v1/completions") >= before + 1


def test_keep_alive_serves_many_requests_and_connection_close_ends_it(pair: tuple[Router, Router]) -> None:
    for r in pair:
        with connect(r) as sock:
            reader = Reader(sock)
            for i in range(3):
                sock.sendall(post("/v1/completions", completion(f"turn {i}")))
                status, headers, _ = reader.answer()
                assert status == 200 and "connection" not in headers
            sock.sendall(post("/v1/completions", completion("last"), headers=AUTH + "connection: close\r\n"))
            status, headers, _ = reader.answer()
            assert status == 200 and headers["connection"] == "close"
            assert reader.closed()  # the server closed the connection after 'connection: close'


def test_a_stream_is_chunked_sse_ending_with_done(pair: tuple[Router, Router]) -> None:
    status, headers, body = both(pair, post("/v1/completions", completion("sse", stream=True)))[0]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 4  # 3 tokens, then [DONE]


def test_a_client_that_leaves_mid_stream_aborts_its_request(pair: tuple[Router, Router]) -> None:
    [decode] = [s for s in pair[0].sims if s.role == "decode"]
    decode.script(token_delay=0.05)  # 400 tokens: the stream outlasts the test by far
    for r in pair:
        before = _outcomes(r, "client_disconnected")
        with connect(r) as sock:
            body = completion("leave", max_tokens=400, stream=True)
            sock.sendall(post("/v1/completions", body))
            reader = Reader(sock)
            reader._until(b"\r\n\r\n")  # the stream's head: the decode is streaming
            reader._until(b"data: ")
        wait_until(lambda r=r, n=before: _outcomes(r, "client_disconnected") == n + 1, what="the disconnect counted")


def _outcomes(r: Router, outcome: str) -> float:
    text = HTTP.get(r.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pdgate_router_requests_total{") and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_slow_headers_get_the_guards_408(pair: tuple[Router, Router]) -> None:
    for r in pair:
        with connect(r) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n")  # and never the rest
            status, _, body = Reader(sock).answer()
        assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"


def test_a_stalled_body_gets_the_guards_408_and_never_reaches_the_proxy(pair: tuple[Router, Router]) -> None:
    for r in pair:
        before = _outcomes(r, "ok")
        with connect(r) as sock:
            body = completion("stall")
            sock.sendall(post("/v1/completions", body)[: -len(body) // 2])  # half the declared body
            status, _, answer = Reader(sock).answer()
        assert status == 408 and orjson.loads(answer)["error"]["code"] == "request_timeout"
        assert _outcomes(r, "ok") == before


@pytest.mark.parametrize(
    "shape",
    ["chunked body", "expect 100-continue", "query string", "HTTP/1.0"],
)
def test_shapes_the_lane_leaves_to_uvicorn_are_still_served(pair: tuple[Router, Router], shape: str) -> None:
    lane, _ = pair
    body = completion(shape)
    if shape == "chunked body":
        raw = post("/v1/completions", b"", headers=AUTH + "transfer-encoding: chunked\r\n", length=False)
        raw += b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    elif shape == "expect 100-continue":
        raw = post("/v1/completions", body, headers=AUTH + "expect: 100-continue\r\n")
    elif shape == "query string":
        raw = post("/v1/completions?x=1", body)
    else:
        raw = post("/v1/completions", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    seen = len(lane.seen)
    for r in pair:
        with connect(r) as sock:
            sock.sendall(raw)
            reader = Reader(sock)
            status, _, answer = reader.answer()
            if status == 100:
                status, _, answer = reader.answer()
        assert status == 200 and len(orjson.loads(answer)["choices"][0]["text"].split()) == 3
    assert [on for _, p, on in lane.seen[seen:] if p.startswith("/v1/completions")] == [False]


def test_an_idle_keep_alive_connection_is_not_cut_by_the_header_timeout(pair: tuple[Router, Router]) -> None:
    """Between requests only the keep-alive timeout counts (the guard's one deadline per connection)."""
    lane, _ = pair
    with connect(lane) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v1/completions", completion("one")))
        assert reader.answer()[0] == 200
        time.sleep(LIMIT_S * 1.5)  # longer than the header timeout, shorter than the keep-alive timeout
        sock.sendall(post("/v1/completions", completion("two")))
        assert reader.answer()[0] == 200


def test_every_lane_route_is_a_route_of_the_app_and_answers_as_uvicorn_does(pair: tuple[Router, Router]) -> None:
    """The lane's routes come from the app's own tables (router/routes.py): each is a route of the app (its
    FastAPI table declares the proxy routes too), and a request to each, sent to both routers, gets the
    same answer, the lane's router having served it on the lane."""
    lane, _ = pair
    routes = lane_routes(lane.dep.settings.embedded)
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= set(routes)
    assert ("PUT", "/v1/handoffs/{transfer_id}/ready") in routes  # the engines' ledger calls, embedded
    # Asked of the routes themselves: FastAPI >= 0.14x wraps the included metaserver router in one route.
    not_in_app = [
        (method, template)
        for method, template in routes
        if not any(
            r.matches({"type": "http", "method": method, "path": re.sub(r"\{[^}]+\}", "x", template)})[0] is Match.FULL
            for r in lane.dep.app.api.routes
        )
    ]
    assert not not_in_app, not_in_app
    for method, template in routes:
        path = re.sub(r"\{[^}]+\}", "lane-none", template)  # a handoff that does not exist: a typed answer
        token = KEY if path.startswith(("/v1/completions", "/v1/chat")) else TOKEN
        before = lane.laned(method, path)
        raw = post(path, b"{}", headers=f"authorization: Bearer {token}\r\n")
        status, _, _ = both(pair, method.encode() + raw.removeprefix(b"POST"))[0]
        # Never "no such route" (405, or a 404 but for the missing handoff): the app serves the route.
        assert status != 405 and (status != 404 or path != template), (method, path, status)
        assert lane.laned(method, path) == before + 1, (method, path)

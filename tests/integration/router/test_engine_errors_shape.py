"""An engine's refusal reaches the client in pdgate's shape, and /version is pdgate's (issue #26 item 6).

Before: a vLLM 400 (a missing prompt) on a passed-through route or on the PD path reached the client as
vLLM wrote it, without `X-PDGate-Error` and with vLLM's integer `code`; `GET /version` answered only the
engine's vLLM version. The engine here is a small real HTTP server that answers as vLLM 0.32 does.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import pdgate
from pdgate.urls import static_instance_id
from tests.integration.router.conftest import Deployment
from tests.support.ports import free_port

MODEL = "fake-model"
TOKEN = "admin-token-for-the-version-test"
VLLM_VERSION = "0.32.0+fake"
# vLLM's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py): {"error": ErrorInfo}
REFUSAL = {
    "error": {
        "message": "Either prompt or prompt_embeds must be provided.",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }
}


class _Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 64}]})
        elif self.path == "/version":
            self._answer(200, {"version": VLLM_VERSION})
        elif self.path == "/health":
            self._answer(200, {})
        else:
            self._answer(404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(400, REFUSAL)  # every POST: the engine refuses the request

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def dep(engine: str) -> Iterator[Deployment]:
    dead = f"http://127.0.0.1:{free_port()}"  # an instance that does not answer: its version is unknown
    with Deployment(prefill=[engine, dead], decode=[engine], model=MODEL, admin_token=TOKEN) as d:
        yield d


def _assert_pdgate_shape(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["x-pdgate-error"] == "upstream_rejected"
    err = r.json()["error"]
    assert err["code"] == "upstream_rejected" and err["type"] == "invalid_request_error"
    assert err["message"] == REFUSAL["error"]["message"] and err["param"] == "prompt"


def test_a_passed_through_route_the_engine_refuses(dep: Deployment) -> None:
    _assert_pdgate_shape(httpx.post(dep.url + "/tokenize", json={"model": MODEL}, timeout=10))


def test_a_completion_the_prefill_refuses(dep: Deployment) -> None:
    r = httpx.post(dep.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2}, timeout=10)
    _assert_pdgate_shape(r)


def test_version_is_pdgates_and_the_admin_reads_each_engines(dep: Deployment, engine: str) -> None:
    public = httpx.get(dep.url + "/version", timeout=10)
    assert public.status_code == 200 and public.json() == {"version": pdgate.__version__}
    wrong = httpx.get(dep.url + "/version", headers={"authorization": "Bearer nope"}, timeout=10)
    assert wrong.json() == {"version": pdgate.__version__}
    admin = httpx.get(dep.url + "/version", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    assert admin["version"] == pdgate.__version__
    engines = admin["engines"]
    assert engines[static_instance_id(engine)] == VLLM_VERSION
    [unknown] = [v for k, v in engines.items() if k != static_instance_id(engine)]
    assert isinstance(unknown, dict) and "error" in unknown

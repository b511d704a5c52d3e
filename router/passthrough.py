"""vLLM's routes besides the two the router splits into prefill and decode, sent whole to one instance.

Why: clients and tools written for `vllm serve` call more than completions. `vllm bench serve` asks
`/tokenize` and `/detokenize` to align its prompts (and warns when they are missing), RAG stacks call
`/v1/embeddings`, dashboards read `/version`. None of these touches the KV handoff, so one instance that
serves the request's model answers it, as it would without pdgate.

Rules: the same client API keys as the OpenAI routes (`access.ClientKeys`), the same forwarding-loop
guard, the same credentials towards the engines (`--upstream-api-key`, or the client's own with
`--forward-client-auth`). The instance: one of the body's `model` (404 `model_not_found` when no
instance serves it), else of the one model this router serves, else any; available instances first,
least loaded first. An instance that answers 404 does not serve that route (vLLM registers
`/v1/embeddings` and `/pooling` only for pooling models): the next one is asked, and when none serves it
the client gets 404 `not_found`. An instance that cannot be reached is skipped; when none answers, 503
`pd_no_instance`. An engine's other 4xx (a missing prompt) is the client's error in pdgate's shape, the
engine's status and message with `X-PDGate-Error: upstream_rejected` (`errors.UpstreamRejected`); any
other answer is relayed as it came, status included.

`GET /version` is the router's own: pdgate's version, for anyone (vLLM's /version is not protected
either). With the admin token it adds each engine's own `/version` answer by instance id, since one
pool may mix vLLM versions and only the admin may read instance ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson
from pdgate.router.access import AdminCheck, ClientKeys
from pdgate.router.errors import (
    ModelNotFound,
    NoInstance,
    PayloadTooLarge,
    RouteNotServed,
    RouterError,
    Unauthorized,
    UpstreamRejected,
)
from pdgate.router.loops import HOP_HEADER, HOP_VALUE, LoopDetected
from pdgate.router.pool import LiveInstance, Pool
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import send_body, send_error
from pdgate.router.tracing import TRACE_HEADERS, trace_context

import pdgate
from pdgate.asgi import Receive, Scope, Send
from pdgate.upstream import Upstream

__all__ = ["GET_ROUTES", "POST_ROUTES", "Passthrough"]

log = logging.getLogger(__name__)

POST_ROUTES = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
GET_ROUTES = frozenset({"/version"})
_TRIES = 3  # distinct instance URLs asked before giving up
_MAX_ANSWER = 64 << 20
_FORWARD = frozenset({b"x-request-id"})
_VERSION_TIMEOUT_S = 5.0  # an engine's /version, asked for the admin view


class Passthrough:
    """The ASGI handler of `POST_ROUTES` and `GET_ROUTES`."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: Pool,
        upstream: Callable[[], Upstream],
        clock: Callable[[], float],
        admin: AdminCheck,
        *,
        trace_dropped: Callable[[], object],
    ) -> None:
        self._pool = pool
        self._admin = admin
        self._trace_dropped = trace_dropped  # counts a malformed trace context that was not forwarded
        self._upstream = upstream
        self._clock = clock
        self._keys = ClientKeys(settings.api_key)
        self._max_body = settings.max_body_bytes
        self._timeout = settings.prefill_timeout_s
        self._upstream_auth = f"Bearer {settings.upstream_api_key}".encode() if settings.upstream_api_key else None
        self._forward_auth = settings.forward_client_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["path"] == "/version":
                await self._version(scope, send)
            else:
                await self._serve(scope, receive, send)
        except RouterError as exc:
            await send_error(send, exc, [], lambda: None)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        auth: bytes | None = None
        headers: list[tuple[bytes, bytes]] = [(HOP_HEADER, HOP_VALUE)]
        trace: list[tuple[bytes, bytes]] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == HOP_HEADER:
                raise LoopDetected(
                    "this request was already forwarded by a pdgate router: an instance URL points at a router"
                )
            elif name in _FORWARD:
                headers.append((name, value))
            elif name in TRACE_HEADERS:
                trace.append((name, value))
        if trace:  # only a well-formed trace context goes on to the engine
            kept, dropped = trace_context(trace)
            headers += kept
            if dropped:
                self._trace_dropped()
        if not self._keys.allows(auth):
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
        if self._upstream_auth is not None:
            headers.append((b"authorization", self._upstream_auth))
        elif self._forward_auth and auth is not None:
            headers.append((b"authorization", auth))
        body = await _read(receive, self._max_body) if method == "POST" else b""
        if body is None:  # the client left (or was cut off) before its body was whole: nothing is sent on
            return
        if body:
            headers.append((b"content-type", b"application/json"))
        query: bytes = scope.get("query_string", b"")
        target = path + ("?" + query.decode("latin-1") if query else "")
        model = _model_of(body)
        tried: list[str] = []
        failures: list[str] = []
        for inst in self._instances(model)[:_TRIES]:
            url = inst.view.url
            tried.append(inst.public)  # what the client reads: opaque names (`Pool.public_name`)
            try:
                resp = await self._upstream().request(method, url + target, headers, body, timeout=self._timeout)
                try:
                    data = await resp.read(timeout=self._timeout, limit=_MAX_ANSWER)
                finally:
                    resp.close()
            except Exception as exc:
                log.warning("%s %s on %s failed: %r", method, path, inst.id, exc)
                failures.append(f"{inst.public}: {type(exc).__name__}")
                continue
            if resp.status == 404:  # this instance does not serve the route; another one may
                continue
            if 400 <= resp.status < 500:  # the client's own error, said by the engine: pdgate's shape
                raise UpstreamRejected(resp.status, data, resp.header(b"content-type"))
            out = [(b"content-type", resp.header(b"content-type") or b"application/json")]
            await send_body(send, resp.status, out, data, lambda: None)
            return
        if failures and len(failures) == len(tried):
            raise NoInstance(f"no instance answered {method} {path}: {'; '.join(failures)}")
        which = f" of model {model}" if model else ""
        asked = f" (asked {', '.join(tried)})" if tried else ""
        raise RouteNotServed(f"no instance{which} serves {method} {path}{asked}")

    async def _version(self, scope: Scope, send: Send) -> None:
        """pdgate's version; with the admin token, each engine's /version answer by instance id too."""
        answer: dict[str, object] = {"version": pdgate.__version__}
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        client = scope.get("client")
        if self._admin.holds(auth.decode("latin-1") if auth else None, client[0] if client else None):
            answer["engines"] = await self._engine_versions()
        await send_body(send, 200, [(b"content-type", b"application/json")], orjson.dumps(answer), lambda: None)

    async def _engine_versions(self) -> dict[str, object]:
        """Each instance's vLLM version (its /version's `version`), or why it is unknown; one call per URL."""
        by_url: dict[str, list[str]] = {}
        for inst in self._pool.instances.values():
            by_url.setdefault(inst.view.url, []).append(inst.id)
        urls = sorted(by_url)
        found = await asyncio.gather(*(self._engine_version(url) for url in urls))
        return {iid: version for url, version in zip(urls, found, strict=True) for iid in sorted(by_url[url])}

    async def _engine_version(self, url: str) -> object:
        headers = [(HOP_HEADER, HOP_VALUE)]
        if self._upstream_auth is not None:
            headers.append((b"authorization", self._upstream_auth))
        try:
            resp = await self._upstream().request("GET", url + "/version", headers, b"", timeout=_VERSION_TIMEOUT_S)
            try:
                data = await resp.read(timeout=_VERSION_TIMEOUT_S, limit=64 << 10)
            finally:
                resp.close()
            version = orjson.loads(data).get("version") if resp.status == 200 else None
        except Exception as exc:  # one engine that does not answer leaves the others' versions
            return {"error": type(exc).__name__}
        return version if isinstance(version, str) else {"error": f"HTTP {resp.status}"}

    def _instances(self, model: str | None) -> list[LiveInstance]:
        pool = self._pool
        if model is not None and model not in pool.prefills and model not in pool.decodes:
            raise ModelNotFound(f"The model `{model}` does not exist.")
        if model is None:
            known = pool.known_models()
            model = known[0] if len(known) == 1 else None
        now = self._clock()
        found = [i for i in pool.instances.values() if model is None or i.view.model == model]
        found.sort(key=lambda i: (i.unavailable(now) is not None, i.requests))
        seen: set[str] = set()
        out = []
        for inst in found:  # DP ranks share a URL: ask each engine once
            if inst.view.url not in seen:
                seen.add(inst.view.url)
                out.append(inst)
        return out


def _model_of(body: bytes) -> str | None:
    if not body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the engine says what is wrong with it
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


async def _read(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client went away first. Why None and not what arrived:
    an engine that got a cut body (an empty one, before) would answer a request nobody sent."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over the limit of {limit} bytes")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)

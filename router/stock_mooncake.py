"""vLLM's own `MooncakeConnector` pair behind the router (`--kv-protocol mooncake`): P and D at once.

vLLM's MooncakeConnector protocol differs from NIXL's in the one way that matters to a router: the
prefill's answer carries no `kv_transfer_params` (its `request_finished` returns None), so the decode's
params cannot come from it. Instead the router names the transfer itself and finds the prefill's engine
the way vLLM's own proxy does (`examples/online_serving/disaggregated_serving/mooncake_connector/
mooncake_connector_proxy.py`): it asks the prefill's bootstrap server (`GET <bootstrap>/query`, the
server each prefill's rank 0 runs on `VLLM_MOONCAKE_BOOTSTRAP_PORT`, default 8998) for the engine id of
the prefill's DP rank, then sends both copies at the same time:
- prefill: the prefill copy of the body (`bodies.SplicedBody.prefill`) with `min_tokens: 1` and
  `{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}`;
- decode: the client's body with `{"do_remote_decode": false, "do_remote_prefill": true,
  "transfer_id": T, "remote_engine_id": E, "remote_bootstrap_addr": "http://<prefill host>:<port>"}`.
The decode asks the prefill's worker for transfer T over ZMQ and the prefill pushes the blocks once its
request has finished; the decode's answer is relayed by `attempts.Dispatcher` as any decode's is.

The unit of retry is the pair, not one side: once a decode asked for T the prefill sends T once, so a
second decode asking for the same T would wait out `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`. A pair that
fails before a byte reached the client is retried with a fresh T on a prefill that did not fail
(`retry.retry_elsewhere`, up to 1 + `--prefill-retries` pairs); the decode side has no retries of its own.
No ledger record is made: the stock connector never reads it (as with stock NIXL, `attempts`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from random import Random
from typing import Any
from urllib.parse import urlsplit

import orjson
from pdgate.router.attempts import Dispatcher
from pdgate.router.bodies import SplicedBody, with_fields
from pdgate.router.errors import (
    UPSTREAM_FAILURES,
    NoCompatiblePair,
    PrefillFailed,
    RouterError,
    UnsupportedByPD,
    Where,
    failed,
    snippet,
    translate,
)
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pairing import InstanceView
from pdgate.router.policies import Policy
from pdgate.router.pool import LiveInstance, Pool
from pdgate.router.request_flow import ProxiedRequest, mint_transfer_id
from pdgate.router.retry import retry_elsewhere
from pdgate.router.settings import RouterSettings

from pdgate.asgi import Message, Send
from pdgate.errors import PDGateError
from pdgate.logs import transfer_id as log_transfer_id
from pdgate.upstream import Upstream

__all__ = [
    "MooncakeBootstrap",
    "StockMooncake",
    "bootstrap_addr",
    "check_mooncake_request",
    "decode_params",
    "prefill_params",
]

log = logging.getLogger("pdgate.router.proxy")

_QUERY_TIMEOUT_S = 5.0
_QUERY_LIMIT = 1 << 20


def prefill_params(transfer_id: str) -> dict[str, Any]:
    """What vLLM's MooncakeConnector prefill reads (`update_state_after_alloc`: do_remote_decode and a
    transfer_id, else it warns and never sends)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def decode_params(transfer_id: str, engine_id: str, bootstrap_addr: str) -> dict[str, Any]:
    """What its decode reads: all three of remote_engine_id, remote_bootstrap_addr and transfer_id, else
    it logs "Got invalid KVTransferParams" and recomputes the prompt."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_addr,
    }


def bootstrap_addr(view: InstanceView, port: int) -> str:
    """The prefill's bootstrap server: the host of its URL, the port every prefill is started with."""
    parts = urlsplit(view.url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class MooncakeBootstrap:
    """The engine id of each prefill's DP rank, as its bootstrap server reports it; cached until the
    prefill fails (a restarted engine registers a new id)."""

    def __init__(self, port: int, upstream: Callable[[], Upstream]) -> None:
        self.port = port
        self._upstream = upstream
        self._ids: dict[tuple[str, int], str] = {}

    def addr(self, view: InstanceView) -> str:
        return bootstrap_addr(view, self.port)

    def forget(self, view: InstanceView) -> None:
        self._ids.pop((self.addr(view), view.dp_rank), None)

    async def engine_id(self, p: LiveInstance) -> str:
        """The engine id, or `PrefillFailed` naming the prefill (retried on another prefill)."""
        view = p.view
        key = (self.addr(view), view.dp_rank)
        found = self._ids.get(key)
        if found is not None:
            return found
        where = Where(*p.where("prefill"))
        resp = None
        try:
            resp = await self._upstream().request("GET", key[0] + "/query", [], b"", timeout=_QUERY_TIMEOUT_S)
            data = await resp.read(timeout=_QUERY_TIMEOUT_S, limit=_QUERY_LIMIT)
        except Exception as exc:
            raise translate(exc, UPSTREAM_FAILURES["prefill"], where) from exc
        finally:
            if resp is not None:
                resp.close()
        if resp.status != 200:
            raise failed(PrefillFailed, where, f"Mooncake bootstrap server answered {resp.status}", snippet(data))
        engine = _engine_of(data, view.dp_rank)
        if engine is None:
            what = f"Mooncake bootstrap server names no engine for DP rank {view.dp_rank}"
            raise failed(PrefillFailed, where, what, snippet(data))
        self._ids[key] = engine
        return engine


def _engine_of(data: bytes, dp_rank: int) -> str | None:
    """`/query`'s answer is `{dp_rank: {"engine_id": ..., "worker_addr": {...}}}` (JSON keys are strings)."""
    try:
        entry = orjson.loads(data).get(str(dp_rank))
    except (orjson.JSONDecodeError, AttributeError):
        return None
    engine = entry.get("engine_id") if isinstance(entry, dict) else None
    return engine if isinstance(engine, str) and engine else None


def check_mooncake_request(body: dict[str, Any]) -> None:
    """Refuse what one Mooncake transfer cannot serve, naming the field, before any engine work."""
    n = body.get("n")
    if type(n) is int and n > 1:
        # vLLM's decode fans `n` into requests sharing one transfer_id; the prefill sends it once.
        raise UnsupportedByPD("'n' above 1 is not supported with --kv-protocol mooncake", "n")
    if body.get("prompt_logprobs") is not None:
        # The prefill computes them but its answer is not awaited before the decode's goes out.
        raise UnsupportedByPD("'prompt_logprobs' is not supported with --kv-protocol mooncake", "prompt_logprobs")


class StockMooncake:
    """The PD step of `proxy.Proxy` for `--kv-protocol mooncake` (see the module docstring)."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        decoder: Dispatcher,
        pool: Pool,
        upstream: Callable[[], Upstream],
        metrics: RouterMetrics,
        prefill_policy: Policy,
        rng: Random,
        clock: Callable[[], float],
    ) -> None:
        self._decoder = decoder  # built with decode_retries=0: the pair is retried here, never one side
        self._pool = pool
        self._policy = prefill_policy
        self._rng = rng
        self._clock = clock
        self._tries = 1 + settings.prefill_retries
        self.bootstrap = MooncakeBootstrap(settings.mooncake_bootstrap_port, upstream)
        self._retries = metrics.retries.labels("prefill")

    async def pd(self, req: ProxiedRequest, model: str, send: Send) -> str:
        """One prompt on a prefill/decode pair; returns its outcome label, or raises a typed error while
        nothing reached the client (the proxy then answers it, or serves the request whole)."""
        check_mooncake_request(req.body)
        bad: list[str] = []  # prefills whose side failed: a decode's failure leaves its prefill eligible

        async def pick(tried: Sequence[str]) -> LiveInstance | None:
            cands = self._pool.prefill_candidates(model, self._clock(), bad)
            if not cands:
                return None
            if tried:
                self._retries.inc()
            return cands[self._policy.choose(cands, req.facts, self._rng) or 0]

        def none_left() -> PDGateError:
            now = self._clock()
            return NoCompatiblePair(self._pool.explain(model, now, public=True), detail=self._pool.explain(model, now))

        async def attempt(p: LiveInstance) -> str:
            try:
                return await self._pair(req, p, send)
            except PrefillFailed:
                bad.append(p.id)
                self.bootstrap.forget(p.view)
                raise

        return await retry_elsewhere("mooncake pair", self._tries, pick, attempt, none_left, self._decoder.pause)

    async def _pair(self, req: ProxiedRequest, p: LiveInstance, send: Send) -> str:
        engine = await self.bootstrap.engine_id(p)
        req.tid = mint_transfer_id()
        log_transfer_id.set(req.tid)
        req.prefill, req.ledger_prefill, req.live = p, False, None
        if req.spliced is None:
            req.spliced = SplicedBody(req.body)
        req.decode_kv = decode_params(req.tid, engine, self.bootstrap.addr(p.view))
        req.decode_kv_json = orjson.dumps(req.decode_kv)
        gate = _Gate(send)
        prefill = asyncio.ensure_future(self._prefill(req, p))
        decode = asyncio.ensure_future(self._decoder.decode(req, gate))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None and not decode.done() and not gate.opened:
                gate.shut = True  # nothing of this decode reaches the client, even if it answers now
                raise _result_error(prefill)  # the decode would wait for KV that never comes
            outcome = await decode
            if prefill.done() and prefill.exception() is not None:
                log.warning("mooncake prefill failed after its decode answered: %s", prefill.exception())
            return outcome
        finally:
            # A prefill still running once its decode answered sent the decode nothing (it sends when its
            # request has finished, and so has answered): it is cancelled with the rest, not waited for.
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()  # closes its engine connection: vLLM aborts the request and frees
            await asyncio.gather(prefill, decode, return_exceptions=True)

    async def _prefill(self, req: ProxiedRequest, p: LiveInstance) -> None:
        assert req.spliced is not None
        # min_tokens 1, as vllm-ascend's proxies send: a prefill whose one token is EOS ends STOPPED, not
        # LENGTH_CAPPED, and vLLM's connector then frees its blocks unsent (`request_finished`) while the
        # decode waits for them until VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s).
        payload = with_fields(req.spliced.prefill(prefill_params(req.tid)), {"min_tokens": 1})
        # Its answer carries nothing the decode needs (see the module docstring): only its status counts.
        await self._decoder.send_prefill(req, p, payload)


class _Gate:
    """The client's send for a pair's decode: once the pair is given up (`shut`) before the decode's
    answer started, that decode can no longer start the client's response; a retry's decode will."""

    __slots__ = ("opened", "send", "shut")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.opened = False
        self.shut = False

    async def __call__(self, msg: Message) -> None:
        if self.shut:
            raise asyncio.CancelledError
        self.opened = True
        await self.send(msg)


def _result_error(task: asyncio.Future[None]) -> BaseException:
    exc = task.exception()
    assert exc is not None
    return exc if isinstance(exc, RouterError) else PrefillFailed(f"prefill failed: {type(exc).__name__}")

"""pdgate-sim: a fast fake vLLM engine that speaks the OpenAI API and the PD protocol, with scripted faults.

What it does, per request (raw ASGI on uvicorn, orjson; thousands of concurrent streams per process):
- `kv_transfer_params.do_remote_decode` -> prefill: wait `prefill_delay`, "allocate" blocks, record READY
  in the ledger (`mark_ready` with a `KVLocation` whose `engine_id` is this instance/rank), answer one
  token with `kv_transfer_params` describing the blocks (`remote_engine_id`, `remote_block_ids`, ...).
- `kv_transfer_params.do_remote_prefill` -> decode: claim the handoff (long-poll while PENDING, poll
  while another decode holds it), check that the params came from the prefill that holds the handoff
  (`location.engine_id == handoff.prefill_instance_id == params.remote_engine_id`; a mismatch is an
  error and is counted), mark DONE, then answer `max_tokens` tokens, streamed or not.
- no params -> a plain (aggregated) completion.
Tokens are derived from the prompt (same prompt, same text); usage is counted in words.

The ledger is the metaserver named by `kv_transfer_params.metaserver`, else `--metaserver`; with
neither, prefill and decode skip the ledger steps (decode still requires `remote_engine_id`).
With `--metaserver` the sim registers one record per DP rank (`<id>` or `<id>.dp<rank>`), heartbeats
with its in-flight load, and deregisters on clean shutdown. A request for DP rank r comes with
`X-data-parallel-rank: r`.

Faults are scripted, never random: `--fail-first N` (the next N requests answer `--fail-status`),
`--fail-rate R` (exactly every 1/R-th request fails), `--die-after-tokens N` (drop the connection after N
tokens), `--hang` (never answer), `--no-kv-params` (a prefill that forgets its params),
`--decode-delay S` (wait before claiming), `--unhealthy` (GET /health answers 503). Tests change them at
run time with `POST /sim/script` and read counters at `GET /sim/stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import orjson
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from metaserver.client import MetaConflict, MetaError, MetaGone, MetaNotFound
from metaserver.models import InstanceLoad, InstanceRegistration, KVLocation, Role, TransportKind
from router.meta import PooledMetaClient
from router.pool import static_instance_id
from router.settings import settings_parser
from router.upstream import HttpPool

__all__ = ["Script", "SimApp", "SimSettings", "create_app", "main"]

log = logging.getLogger("router.sim")

_VOCAB = (
    "the of and to in is was for on that with as by at from it an be this which or are have had not "
    "were but they his one all their there been has when who will more no if out so said what up its"
).split()
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PDGATE_SIM_", extra="ignore", frozen=True)

    role: Literal["prefill", "decode", "both"] = Field("both", description="which side of PD this engine serves")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8100, ge=0, le=65535, description="port to listen on")
    metaserver: str | None = Field(None, description="metaserver URL: register there and use it as the ledger")
    metaserver_token: str | None = Field(None, description="admin token for the metaserver's write routes")
    metaserver_timeout_s: float = Field(5.0, gt=0, description="timeout of one call to the metaserver")
    advertise_url: str | None = Field(None, description="URL the router reaches this engine at (default host:port)")
    model: str = Field("sim-model", description="served model name")
    instance_id: str | None = Field(None, description="instance id (default: derived from the advertised URL)")
    block_size: int = Field(16, ge=1, description="KV block size advertised")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks (one registry record each)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size advertised")
    kv_dtype: str = Field("auto", description="KV dtype advertised")
    kv_layout: str = Field("", description="KV layout tag advertised")
    kv_replicated: bool = Field(False, description="advertise KV replicated on every TP rank")
    transport: TransportKind = Field(TransportKind.SIM, description="transport kind advertised")
    max_model_len: int = Field(32768, ge=2, description="prompt + max_tokens above this get 400, like vLLM")
    lease_s: float = Field(10.0, gt=0, description="registry lease; heartbeats every third of it")
    claim_wait_s: float = Field(30.0, gt=0, description="decode: longest wait for the handoff to be claimable")
    claim_lease_s: float | None = Field(None, gt=0, description="decode: claim lease asked for")
    prefill_delay: float = Field(0.0, ge=0, description="seconds a prefill takes")
    token_delay: float = Field(0.0, ge=0, description="seconds between decode tokens")
    decode_delay: float = Field(0.0, ge=0, description="seconds a decode waits before claiming")
    fail_first: int = Field(0, ge=0, description="the next N requests fail with --fail-status")
    fail_status: int = Field(503, ge=400, le=599, description="status of scripted failures")
    fail_rate: float = Field(0.0, ge=0, le=1, description="fraction of requests that fail, evenly spaced")
    die_after_tokens: int | None = Field(None, ge=0, description="drop the connection after N decode tokens")
    hang: bool = Field(False, description="never answer completions (until the client goes away)")
    no_kv_params: bool = Field(False, description="prefill answers without kv_transfer_params")
    unhealthy: bool = Field(False, description="GET /health answers 503")
    hold_until: int = Field(0, ge=0, description="hold requests until this many are in flight together (max 60 s)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("warning", description="log level")


@dataclass
class Script:
    """The faults and delays in force; `POST /sim/script` replaces any subset."""

    prefill_delay: float = 0.0
    token_delay: float = 0.0
    decode_delay: float = 0.0
    fail_first: int = 0
    fail_status: int = 503
    fail_rate: float = 0.0
    die_after_tokens: int | None = None
    hang: bool = False
    no_kv_params: bool = False
    unhealthy: bool = False
    hold_until: int = 0  # hold every request until this many are in flight at once (max 60 s)

    @classmethod
    def from_settings(cls, s: SimSettings) -> Script:
        return cls(**{f.name: getattr(s, f.name) for f in fields(cls)})

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"unknown script fields: {', '.join(sorted(unknown))}")
        for k, v in changes.items():
            setattr(self, k, v)


class _Died(Exception):
    """Raised on purpose (--die-after-tokens): uvicorn then closes the connection mid-answer."""


class _QuietDeath(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Died))


class _Stats:
    def __init__(self, dp_size: int) -> None:
        self.counts: dict[str, int] = {}
        self.by_rank = [0] * dp_size
        self.inflight = [0] * dp_size
        self.max_inflight = 0
        self.log: deque[dict[str, Any]] = deque(maxlen=8192)

    def inc(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def snapshot(self, with_log: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "counts": self.counts,
            "by_rank": self.by_rank,
            "inflight": self.inflight,
            "max_inflight": self.max_inflight,
        }
        if with_log:
            out["log"] = list(self.log)
        return out


class _Reject(Exception):
    def __init__(self, status: int, message: str, code: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code if code is not None else status


def _words(text: str) -> int:
    return max(1, len(text.split()))


class SimApp:
    """The simulator's ASGI app (raw: the simulator must stay cheap next to the router it loads)."""

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self.url = (settings.advertise_url or f"http://{settings.host}:{settings.port}").rstrip("/")
        self.base_id = settings.instance_id or static_instance_id(self.url)
        self.role = Role(settings.role)
        self.script = Script.from_settings(settings)
        self.stats = _Stats(settings.dp_size)
        self._served = 0
        self._next_block = 0
        self._http: HttpPool | None = None
        self._clients: dict[str, PooledMetaClient] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._registered: set[int] = set()
        self._gate = asyncio.Event()
        logging.getLogger("uvicorn.error").addFilter(_QuietDeath())

    def record_id(self, rank: int) -> str:
        return self.base_id if self.s.dp_size == 1 else f"{self.base_id}.dp{rank}"

    # -- ASGI -------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                await self._completion(scope, receive, send, chat=path.endswith("chat/completions"))
            elif path == "/health":
                status = 503 if self.script.unhealthy else 200
                await _reply(send, status, {"status": "ok" if status == 200 else "unhealthy"})
            elif path == "/v1/models":
                card = {"id": self.s.model, "object": "model", "created": 0, "owned_by": "pdgate-sim"}
                await _reply(send, 200, {"object": "list", "data": [{**card, "max_model_len": self.s.max_model_len}]})
            elif path == "/sim/stats":
                await _reply(send, 200, self.stats.snapshot(b"log=1" in scope.get("query_string", b"")))
            elif path == "/sim/script" and method == "POST":
                self.script.update(orjson.loads(await _body(receive)))
                self._gate.clear()
                await _reply(send, 200, asdict(self.script))
            elif path == "/sim/reset" and method == "POST":
                self.stats = _Stats(self.s.dp_size)
                self._served = 0
                await _reply(send, 200, {"ok": True})
            else:
                raise _Reject(404, f"no route {method} {path}")
        except _Reject as exc:
            await _reply(send, exc.status, _error(exc))
        except (ValueError, orjson.JSONDecodeError) as exc:
            await _reply(send, 400, _error(_Reject(400, str(exc))))

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        self._http = HttpPool()
        if self.s.metaserver:
            await self._register_all()
            self._heartbeat = asyncio.create_task(self._heartbeat_loop())

    async def shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self.s.metaserver:
            meta = self._meta(self.s.metaserver)
            for rank in sorted(self._registered):
                with contextlib.suppress(MetaError):
                    await meta.deregister(self.record_id(rank))
        for client in self._clients.values():
            await client.aclose()
        if self._http is not None:
            await self._http.aclose()

    # -- registry ---------------------------------------------------------------------------

    def _meta(self, url: str) -> PooledMetaClient:
        client = self._clients.get(url)
        if client is None:
            assert self._http is not None
            client = PooledMetaClient(
                url, pool=self._http, token=self.s.metaserver_token, timeout=self.s.metaserver_timeout_s
            )
            self._clients[url] = client
        return client

    def registration(self, rank: int) -> InstanceRegistration:
        s = self.s
        return InstanceRegistration(
            id=self.record_id(rank),
            role=self.role,
            url=self.url,
            model=s.model,
            dp_rank=rank,
            dp_size=s.dp_size,
            tp_size=s.tp_size,
            block_size=s.block_size,
            kv_dtype=s.kv_dtype,
            kv_layout=s.kv_layout,
            kv_replicated=s.kv_replicated,
            transport=s.transport,
            engine_id=self.record_id(rank),
            lease_s=s.lease_s,
        )

    async def _register_all(self) -> None:
        """Register every rank not registered yet; a metaserver that is not up yet is retried later."""
        assert self.s.metaserver
        meta = self._meta(self.s.metaserver)
        for rank in range(self.s.dp_size):
            if rank in self._registered:
                continue
            try:
                await meta.register(self.registration(rank))
                self._registered.add(rank)
            except MetaError as exc:
                log.warning("registering %s failed (will retry): %s", self.record_id(rank), exc.detail)

    async def _heartbeat_loop(self) -> None:
        assert self.s.metaserver
        meta = self._meta(self.s.metaserver)
        while True:
            pending = len(self._registered) < self.s.dp_size
            await asyncio.sleep(0.2 if pending else self.s.lease_s / 3)
            await self._register_all()
            for rank in sorted(self._registered):
                load = InstanceLoad(running=self.stats.inflight[rank])
                try:
                    await meta.heartbeat(self.record_id(rank), load)
                except MetaNotFound:  # our lease lapsed (e.g. the metaserver restarted): register again
                    self._registered.discard(rank)
                except MetaError as exc:
                    log.warning("heartbeat of %s failed: %s", self.record_id(rank), exc.detail)

    # -- completions ------------------------------------------------------------------------

    async def _completion(self, scope: dict[str, Any], receive: Callable, send: Callable, chat: bool) -> None:
        body = orjson.loads(await _body(receive))
        if not isinstance(body, dict):
            raise _Reject(400, "body must be a JSON object")
        rank, rid = 0, ""
        for name, value in scope["headers"]:
            if name == b"x-data-parallel-rank":
                rank = int(value)
            elif name == b"x-request-id":
                rid = value.decode("latin-1")
        if not 0 <= rank < self.s.dp_size:
            raise _Reject(400, f"data parallel rank {rank} out of range (dp_size {self.s.dp_size})")
        kv = body.get("kv_transfer_params") or {}
        mode = "prefill" if kv.get("do_remote_decode") else "decode" if kv.get("do_remote_prefill") else "plain"
        st = self.stats
        st.inc("requests")
        st.inc(mode)
        st.by_rank[rank] += 1
        entry = {
            "mode": mode,
            "transfer_id": kv.get("transfer_id"),
            "request_id": rid,
            "dp_rank": rank,
            "status": 0,
            "body": {k: v for k, v in body.items() if k not in ("prompt", "messages")},
        }
        st.log.append(entry)
        st.inflight[rank] += 1
        total = sum(st.inflight)
        st.max_inflight = max(st.max_inflight, total)
        if self.script.hold_until and total >= self.script.hold_until:
            self._gate.set()
        disconnected = asyncio.ensure_future(receive())
        try:
            entry["status"] = await self._answer(body, kv, mode, rank, rid, chat, send, disconnected)
        except _Reject as exc:
            entry["status"] = exc.status
            st.inc(f"status_{exc.status}")
            await _reply(send, exc.status, _error(exc))
        finally:
            st.inflight[rank] -= 1
            if not disconnected.done():
                disconnected.cancel()

    def _scripted_failure(self) -> bool:
        sc = self.script
        self._served += 1
        if sc.fail_first > 0:
            sc.fail_first -= 1
            return True
        if sc.fail_rate > 0:
            n = self._served
            return int(n * sc.fail_rate) > int((n - 1) * sc.fail_rate)
        return False

    async def _answer(
        self,
        body: dict[str, Any],
        kv: dict[str, Any],
        mode: str,
        rank: int,
        rid: str,
        chat: bool,
        send: Callable,
        disconnected: asyncio.Future[Any],
    ) -> int:
        if mode == "prefill" and not self.role.can_prefill():
            raise _Reject(400, f"{self.base_id} is a {self.role.value} instance: it does not prefill")
        if mode == "decode" and not self.role.can_decode():
            raise _Reject(400, f"{self.base_id} is a {self.role.value} instance: it does not decode")
        sc = self.script
        if sc.hold_until and not self._gate.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gate.wait(), 60)
        if self._scripted_failure():
            self.stats.inc("scripted_failures")
            raise _Reject(sc.fail_status, f"scripted failure of {self.base_id}")
        if sc.hang:
            await asyncio.shield(disconnected)
            self.stats.inc("cancelled")
            return 499
        text, prompt_tokens = _prompt(body, chat)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if prompt_tokens + max_tokens > self.s.max_model_len:
            raise _Reject(
                400,
                f"This model's maximum context length is {self.s.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )
        tokens = _tokens(text, max_tokens)
        meta_url = kv.get("metaserver") or self.s.metaserver
        tid = kv.get("transfer_id")
        out_params = None
        if mode == "prefill":
            if not await _pause(sc.prefill_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            out_params = await self._prefill(kv, rank, prompt_tokens, meta_url, tid, rid)
            tokens = tokens[:1]
        elif mode == "decode":
            if not await _pause(sc.decode_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            await self._claim(kv, rank, meta_url, tid)
        stream = bool(body.get("stream")) and mode != "prefill"
        if stream:
            return await self._stream(body, tokens, prompt_tokens, chat, rid, send, disconnected)
        payload = _full(body, tokens, prompt_tokens, chat, rid, out_params)
        if sc.die_after_tokens is not None and mode != "prefill":
            await send({"type": "http.response.start", "status": 200, "headers": _with_length(_JSON, payload)})
            await send({"type": "http.response.body", "body": payload[: len(payload) // 2], "more_body": True})
            self.stats.inc("died")
            raise _Died("scripted death")
        await _send_all(send, 200, _JSON, payload)
        return 200

    async def _prefill(
        self, kv: dict[str, Any], rank: int, prompt_tokens: int, meta_url: str | None, tid: str | None, rid: str
    ) -> dict[str, Any] | None:
        n_blocks = max(1, -(-prompt_tokens // self.s.block_size))
        blocks = list(range(self._next_block, self._next_block + n_blocks))
        self._next_block += n_blocks
        engine_id = self.record_id(rank)
        remote_rid = f"cmpl-{rid or tid or 'sim'}-0-{self._next_block:08x}"
        if meta_url and tid:
            location = KVLocation(
                block_ids=[blocks],
                num_tokens=prompt_tokens,
                engine_id=engine_id,
                host=self.s.host,
                dp_rank=rank,
                tp_size=self.s.tp_size,
                block_size=self.s.block_size,
                kv_dtype=self.s.kv_dtype,
                kv_layout=self.s.kv_layout,
                transport=self.s.transport,
                remote_request_id=remote_rid,
            )
            try:
                await self._meta(meta_url).mark_ready(tid, location)
            except MetaError as exc:
                self.stats.inc("ledger_errors")
                raise _Reject(500, f"could not record READY for {tid}: {exc.detail}", "ledger_error") from exc
        else:
            self.stats.inc("prefill_without_ledger")
        if self.script.no_kv_params:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_block_ids": [blocks],
            "remote_host": self.s.host,
            "remote_port": self.s.port,
            "remote_request_id": remote_rid,
            "remote_dp_rank": rank,
            "remote_num_tokens": prompt_tokens,
            "tp_size": self.s.tp_size,
            "transfer_id": tid,
            "kv_key": kv.get("kv_key"),
        }

    async def _claim(self, kv: dict[str, Any], rank: int, meta_url: str | None, tid: str | None) -> None:
        engine = kv.get("remote_engine_id")
        if not engine:
            raise _Reject(400, "decode request without remote_engine_id in kv_transfer_params")
        if not (meta_url and tid):
            self.stats.inc("decode_without_ledger")
            return
        meta = self._meta(meta_url)
        me = self.record_id(rank)
        deadline = time.monotonic() + self.s.claim_wait_s
        while True:
            try:
                h = await meta.claim(tid, me, self.s.claim_lease_s)
                break
            except (MetaGone, MetaNotFound) as exc:
                self.stats.inc("kv_expired")
                raise _Reject(410, f"handoff {tid} is gone: {exc.detail}", "kv_expired") from exc
            except MetaConflict as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Reject(504, f"handoff {tid} was not claimable within {self.s.claim_wait_s:g} s") from exc
                if exc.current_state is not None and exc.current_state.value == "PENDING":
                    await meta.get_handoff(tid, wait=min(left, 10.0))
                else:  # another decode holds the claim: its lease lapses back to READY
                    await asyncio.sleep(min(left, 0.05))
            except MetaError as exc:
                self.stats.inc("ledger_errors")
                raise _Reject(503, f"ledger unavailable: {exc.detail}", "ledger_error") from exc
        loc = h.location
        if loc is None or loc.engine_id != h.prefill_instance_id or engine != loc.engine_id:
            self.stats.inc("mismatches")
            with contextlib.suppress(MetaError):
                await meta.abort(tid, "kv_transfer_params do not match the handoff")
            raise _Reject(
                500,
                f"kv_transfer_params name engine {engine!r} but handoff {tid} is held by prefill "
                f"{h.prefill_instance_id!r} with KV on {loc.engine_id if loc else None!r}",
                "kv_mismatch",
            )
        try:
            await meta.done(tid, me)
        except MetaError as exc:
            self.stats.inc("ledger_errors")
            raise _Reject(500, f"could not record DONE for {tid}: {exc.detail}", "ledger_error") from exc
        self.stats.inc("claimed")

    async def _stream(
        self,
        body: dict[str, Any],
        tokens: list[str],
        prompt_tokens: int,
        chat: bool,
        rid: str,
        send: Callable,
        disconnected: asyncio.Future[Any],
    ) -> int:
        sc = self.script
        created = int(time.time())
        model = body.get("model") or self.s.model
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": created, "model": model}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        if chat:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            await send({"type": "http.response.body", "body": _event(first), "more_body": True})
        last = len(tokens) - 1
        for i, tok in enumerate(tokens):
            if sc.die_after_tokens is not None and i >= sc.die_after_tokens:
                self.stats.inc("died")
                raise _Died("scripted death")
            if i and sc.token_delay and not await _pause(sc.token_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            if disconnected.done():
                self.stats.inc("cancelled")
                return 499
            finish = "length" if i == last else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": tok}
            else:
                choice["text"] = tok
            await send({"type": "http.response.body", "body": _event({**head, "choices": [choice]}), "more_body": True})
        tail = b""
        if usage:
            u = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens)}
            u["total_tokens"] = prompt_tokens + len(tokens)
            tail = _event({**head, "choices": [], "usage": u})
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        self.stats.inc("streams_completed")
        return 200


def _prompt(body: dict[str, Any], chat: bool) -> tuple[str, int]:
    if chat:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        text = "\n".join(parts)
        return text, _words(text) + 4 * len(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return " ".join(map(str, prompt)), len(prompt)
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return " ".join(map(str, prompt)), len(prompt)
    return str(prompt), _words(str(prompt))


def _tokens(text: str, n: int) -> list[str]:
    seed = int.from_bytes(hashlib.blake2b(text.encode()[:4096], digest_size=8).digest(), "little")
    v = len(_VOCAB)
    return [" " + _VOCAB[(seed >> (i % 48) ^ i * 2654435761) % v] for i in range(n)]


def _full(
    body: dict[str, Any], tokens: list[str], prompt_tokens: int, chat: bool, rid: str, kv: dict[str, Any] | None
) -> bytes:
    text = "".join(tokens)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens)}
    usage["total_tokens"] = prompt_tokens + len(tokens)
    model = body.get("model") or ""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason="length", stop_reason=None)
    out = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "kv_transfer_params": kv,
    }
    return orjson.dumps(out)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(exc: _Reject) -> dict[str, Any]:
    kind = "BadRequestError" if exc.status < 500 else "InternalServerError"
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}


def _with_length(headers: Sequence[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    return [*headers, (b"content-length", str(len(body)).encode())]


async def _send_all(send: Callable, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _with_length(headers, body)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _reply(send: Callable, status: int, obj: Any) -> None:
    await _send_all(send, status, _JSON, orjson.dumps(obj))


async def _body(receive: Callable) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)


async def _pause(seconds: float, disconnected: asyncio.Future[Any]) -> bool:
    """Sleep, unless the client goes away first: False then."""
    if seconds <= 0:
        return not disconnected.done()
    done, _ = await asyncio.wait({disconnected}, timeout=seconds)
    return not done


def create_app(settings: SimSettings | None = None) -> SimApp:
    return SimApp(settings or SimSettings())


def parse_cli(argv: Sequence[str] | None = None) -> SimSettings:
    parser = settings_parser(
        SimSettings,
        prog="pdgate-sim",
        description="pdgate-sim: a fake vLLM prefill/decode engine for tests and benchmarks.",
        env_prefix="PDGATE_SIM_",
    )
    return SimSettings(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    settings = parse_cli(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        log_config=None,
        loop="auto",
        http="auto",
        backlog=4096,
        timeout_keep_alive=30,
        proxy_headers=False,  # no X-Forwarded-* rewriting: saves a middleware on every request
    )


if __name__ == "__main__":
    main()

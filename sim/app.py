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
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import orjson
from pdgate.metaserver.client import MetaError
from pdgate.metaserver.models import Role
from pdgate.router.meta import PooledMetaClient
from pdgate.router.pool import static_instance_id
from pdgate.router.sim_holds import Holds
from pdgate.router.sim_ledger import SimLedger
from pdgate.router.sim_settings import Script, SimSettings, _Stats, parse_cli
from pdgate.router.sim_wire import (
    _JSON,
    _SSE,
    _body,
    _Died,
    _error,
    _event,
    _full,
    _pause,
    _prompt,
    _QuietDeath,
    _Reject,
    _reply,
    _send_all,
    _tokens,
    _with_length,
)
from pdgate.router.upstream import HttpPool

__all__ = ["Script", "SimApp", "SimSettings", "create_app", "main", "parse_cli"]


class SimApp(SimLedger):
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
        self.holds = Holds()
        self._hold_tasks: list[asyncio.Task[None]] = []
        logging.getLogger("uvicorn.error").addFilter(_QuietDeath())

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
                snap = self.stats.snapshot(b"log=1" in scope.get("query_string", b""))
                await _reply(send, 200, {**snap, **self.holds.snapshot()})
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
            if self.role.can_prefill():
                meta = self._meta(self.s.metaserver)
                feeds = [self.holds.follow(meta, self.record_id(r)) for r in range(self.s.dp_size)]
                self._hold_tasks = [asyncio.create_task(c) for c in [*feeds, self.holds.check(self._meta)]]

    async def shutdown(self) -> None:
        await Holds.stop(self._hold_tasks)
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


def create_app(settings: SimSettings | None = None) -> SimApp:
    return SimApp(settings or SimSettings())


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

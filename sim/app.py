"""pdgate-sim's ASGI app: routes, the completion flow (prefill, decode or plain), streams and `main`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from pdgate.sim.holds import Holds
from pdgate.sim.ledger import Ledger
from pdgate.sim.sampling import apply_stop, choices, logprobs_of
from pdgate.sim.settings import Script, SimSettings, Stats, parse_cli
from pdgate.sim.wire import (
    JSON_HEADERS,
    SSE_HEADERS,
    CharPrompt,
    Died,
    QuietDeath,
    Reject,
    char_prompt,
    chat_prompt,
    continuation,
    error_body,
    event,
    full_answer,
    pause,
    prompt_of,
    read_body,
    reply,
    send_all,
    validate_completion,
    with_length,
)

from pdgate.asgi import Receive, Scope, Send
from pdgate.contract import InvalidTransferParams, KVTransferParams
from pdgate.models import Role
from pdgate.urls import static_instance_id

__all__ = ["SimApp", "create_app", "main"]


@dataclass(frozen=True)
class Out:
    """One answer's output: its tokens and their ids, the (prompt ids, output ids) a client asked for, and
    its (finish_reason, stop_reason)."""

    tokens: list[str]
    token_ids: list[int]
    ids: tuple[list[int], list[int]] | None
    finish: tuple[str, Any]


class SimApp:
    """The simulator's ASGI app (raw: the simulator must stay cheap next to the router it loads)."""

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self.url = (settings.advertise_url or f"http://{settings.host}:{settings.port}").rstrip("/")
        self.base_id = settings.instance_id or static_instance_id(self.url)
        self.role = Role(settings.role)
        self.script = Script.from_settings(settings)
        self.stats = Stats(settings.dp_size)
        self.holds = Holds()
        self.ledger = Ledger(settings, self.url, self.base_id, self.role, self.script, self.stats, self.holds)
        self._served = 0
        self._heartbeat: asyncio.Task[None] | None = None
        self._gate = asyncio.Event()
        self._hold_tasks: list[asyncio.Task[None]] = []
        logging.getLogger("uvicorn.error").addFilter(QuietDeath())

    def record_id(self, rank: int) -> str:
        return self.ledger.record_id(rank)

    def registration(self, rank: int) -> Any:
        return self.ledger.registration(rank)

    # -- ASGI -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
                self.stats.inc("health_probes")
                if self.script.health_delay:
                    await asyncio.sleep(self.script.health_delay)
                status = 503 if self.script.unhealthy else 200
                await reply(send, status, {"status": "ok" if status == 200 else "unhealthy"})
            elif path == "/v1/models":
                card = {"id": self.s.model, "object": "model", "created": 0, "owned_by": "pdgate-sim"}
                await reply(send, 200, {"object": "list", "data": [{**card, "max_model_len": self.s.max_model_len}]})
            elif path == "/sim/stats":
                snap = self.stats.snapshot(b"log=1" in scope.get("query_string", b""))
                await reply(send, 200, {**snap, **self.holds.snapshot()})
            elif path == "/sim/script" and method == "POST":
                self.script.update(orjson.loads(await read_body(receive)))
                self._gate.clear()
                await reply(send, 200, asdict(self.script))
            elif path == "/sim/reset" and method == "POST":
                self.stats.reset()
                self._served = 0
                await reply(send, 200, {"ok": True})
            else:
                raise Reject(404, f"no route {method} {path}")
        except Reject as exc:
            await reply(send, exc.status, error_body(exc))
        except (ValueError, orjson.JSONDecodeError) as exc:
            await reply(send, 400, error_body(Reject(400, str(exc))))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
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
        if self.s.metaserver:
            await self.ledger.register_all()
            self._heartbeat = asyncio.create_task(self.ledger.heartbeat_loop())
            if self.role.can_prefill():
                meta = self.ledger.meta(self.s.metaserver)
                feeds = [self.holds.follow(meta, self.record_id(r)) for r in range(self.s.dp_size)]
                self._hold_tasks = [asyncio.create_task(c) for c in [*feeds, self.holds.check(self.ledger.meta)]]

    async def shutdown(self) -> None:
        await Holds.stop(self._hold_tasks)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self.s.metaserver:
            await self.ledger.deregister_all()
        await self.ledger.aclose()

    # -- completions ------------------------------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = orjson.loads(await read_body(receive))
        if not isinstance(body, dict):
            raise Reject(400, "body must be a JSON object")
        rank, rid = 0, ""
        for name, value in scope["headers"]:
            if name == b"x-data-parallel-rank":
                rank = int(value)
            elif name == b"x-request-id":
                rid = value.decode("latin-1")
        if not 0 <= rank < self.s.dp_size:
            raise Reject(400, f"data parallel rank {rank} out of range (dp_size {self.s.dp_size})")
        validate_completion(body, chat)
        cp = (chat_prompt(body) if chat else char_prompt(body)) if self.s.token_ids else None
        try:
            kv = KVTransferParams.parse(body.get("kv_transfer_params") or {})
        except InvalidTransferParams as exc:
            raise Reject(400, exc.message) from exc
        mode = "prefill" if kv.do_remote_decode else "decode" if kv.do_remote_prefill else "plain"
        st = self.stats
        st.inc("requests")
        st.inc(mode)
        st.by_rank[rank] += 1
        entry: dict[str, Any] = {
            "mode": mode,
            "transfer_id": kv.transfer_id,
            "request_id": rid,
            "dp_rank": rank,
            "status": 0,
            "body": {k: v for k, v in body.items() if k not in ("prompt", "messages")},
        }
        if cp is not None and not chat:  # what a router sent as the prompt is part of what tests check
            entry["prompt_token_ids"] = cp.ids
        st.log.append(entry)
        st.inflight[rank] += 1
        total = sum(st.inflight)
        st.max_inflight = max(st.max_inflight, total)
        if self.script.hold_until and total >= self.script.hold_until:
            self._gate.set()
        disconnected = asyncio.ensure_future(receive())
        try:
            entry["status"] = await self._answer(body, cp, kv, mode, rank, rid, chat, send, disconnected)
        except Reject as exc:
            entry["status"] = exc.status
            st.inc(f"status_{exc.status}")
            await reply(send, exc.status, error_body(exc))
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
        cp: CharPrompt | None,
        kv: KVTransferParams,
        mode: str,
        rank: int,
        rid: str,
        chat: bool,
        send: Send,
        disconnected: asyncio.Future[Any],
    ) -> int:
        if mode == "prefill" and not self.role.can_prefill():
            raise Reject(400, f"{self.base_id} is a {self.role.value} instance: it does not prefill")
        if mode == "decode" and not self.role.can_decode():
            raise Reject(400, f"{self.base_id} is a {self.role.value} instance: it does not decode")
        sc = self.script
        if sc.hold_until and not self._gate.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gate.wait(), 60)
        if self._scripted_failure():
            self.stats.inc("scripted_failures")
            raise Reject(sc.fail_status, f"scripted failure of {self.base_id}")
        if sc.hang:
            await asyncio.shield(disconnected)
            self.stats.inc("cancelled")
            return 499
        if cp is None:
            text, prompt_tokens = prompt_of(body, chat)
        else:
            text, prompt_tokens = cp.text, len(cp.ids)
        max_tokens: int = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if prompt_tokens + max_tokens > self.s.max_model_len:
            raise Reject(
                400,
                f"This model's maximum context length is {self.s.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )
        tokens, token_ids = continuation(text, max_tokens, cp.generated if cp else 0)
        finish: tuple[str, Any] = ("length", None)
        if mode != "prefill" and body.get("stop"):
            tokens, token_ids, *end = apply_stop(body, tokens, token_ids)
            finish = (end[0], end[1])
        # (prompt ids, output ids) for a client that asked, as vLLM answers `return_token_ids`
        ids = (cp.ids, token_ids) if cp is not None and body.get("return_token_ids") else None
        meta_url = kv.metaserver or self.s.metaserver
        out_params = None
        if mode == "prefill":
            if not await pause(sc.prefill_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            out_params = await self.ledger.prefill(kv, rank, prompt_tokens, meta_url, rid)
            tokens = tokens[:1]
            if ids is not None:
                ids = (ids[0], ids[1][:1])
        elif mode == "decode":
            if not await pause(sc.decode_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            await self.ledger.claim(kv, rank, meta_url)
        stream = bool(body.get("stream")) and mode != "prefill"
        if stream:
            out = Out(tokens, token_ids, ids, finish)
            return await self._stream(body, out, prompt_tokens, chat, rid, send, disconnected)
        extra = {
            "finish": finish,
            "n": choices(body) if self.s.token_ids else 1,
            "logprobs": logprobs_of(body, chat, tokens, token_ids),
        }
        payload = full_answer(body, tokens, prompt_tokens, chat, rid, out_params, ids, **extra)
        if sc.die_after_tokens is not None and mode != "prefill":
            await send({"type": "http.response.start", "status": 200, "headers": with_length(JSON_HEADERS, payload)})
            await send({"type": "http.response.body", "body": payload[: len(payload) // 2], "more_body": True})
            self.stats.inc("died")
            raise Died("scripted death")
        await send_all(send, 200, JSON_HEADERS, payload)
        return 200

    async def _stream(
        self,
        body: dict[str, Any],
        out: Out,
        prompt_tokens: int,
        chat: bool,
        rid: str,
        send: Send,
        disconnected: asyncio.Future[Any],
    ) -> int:
        """The answer as SSE; with `ids`, the first chunk carries the prompt's ids and each chunk its
        token's id (vLLM's stream with `return_token_ids`); `n` choices interleaved, token by token."""
        sc = self.script
        tokens, ids, n = out.tokens, out.ids, choices(body) if self.s.token_ids else 1
        created = int(time.time())
        model = body.get("model") or self.s.model
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": created, "model": model}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if chat:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            if ids is not None:  # vLLM's chat stream: the prompt's ids on the response, in the first chunk
                first["prompt_token_ids"] = ids[0]
            await send({"type": "http.response.body", "body": event(first), "more_body": True})
        last = len(tokens) - 1
        for i, tok in enumerate(tokens):
            if sc.die_after_tokens is not None and i >= sc.die_after_tokens:
                self.stats.inc("died")
                raise Died("scripted death")
            if i and sc.token_delay and not await pause(sc.token_delay, disconnected):
                self.stats.inc("cancelled")
                return 499
            if disconnected.done():
                self.stats.inc("cancelled")
                return 499
            choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish[0] if i == last else None}
            if choice["finish_reason"] == "stop":
                choice["stop_reason"] = out.finish[1]
            if chat:
                choice["delta"] = {"content": tok}
            else:
                choice["text"] = tok
            lp = logprobs_of(body, chat, [tok], out.token_ids[i : i + 1], len("".join(tokens[:i])))
            if lp is not None:
                choice["logprobs"] = lp
            if ids is not None:
                if not chat:
                    choice["prompt_token_ids"] = None if i else ids[0]
                choice["token_ids"] = [ids[1][i]]
            for j in range(n):
                events = event({**head, "choices": [{**choice, "index": j}]})
                await send({"type": "http.response.body", "body": events, "more_body": True})
        if out.finish[0] == "stop" and not tokens:  # stopped before any token: the finish alone
            end = {"index": 0, "finish_reason": "stop", "stop_reason": out.finish[1]}
            end.update({"delta": {"content": ""}} if chat else {"text": ""})
            for j in range(n):
                await send(
                    {
                        "type": "http.response.body",
                        "body": event({**head, "choices": [{**end, "index": j}]}),
                        "more_body": True,
                    }
                )
        tail = b""
        if usage:
            u = {"prompt_tokens": prompt_tokens, "completion_tokens": n * len(tokens)}
            u["total_tokens"] = prompt_tokens + u["completion_tokens"]
            tail = event({**head, "choices": [], "usage": u})
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

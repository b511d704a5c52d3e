"""Chaos load: N concurrent streaming clients plus a trickle of non-streaming ones, on the official `openai` client.

It runs as its own process (`python bench/chaos_load.py ...`) so that the orchestrator can inject faults
while it runs, the load can be started inside a network namespace, and its CPU is not mixed with the
orchestrator's. Every finished request is one JSON line in `--out`, written as it finishes, so the
orchestrator can watch the error rate live and decide when the stack has recovered.

A request ends in exactly one class:
  ok       a 200 with all `max_tokens` tokens and a finish_reason (streams: then the end of the stream)
  typed    an error the client can act on: an HTTP error or an SSE error event whose `code` is one of
           pdgate's codes (pdgate.errors.Code)
  untyped  everything else: a 5xx without such a code, an empty or truncated 200, a connection reset with no
           error event, a client timeout. The chaos suite requires zero of these.
  client   the load generator's own artefact, reported apart and never counted as untyped: a connection
           error while this process itself was stalled (its event loop did not run) for longer than
           `--client-stall-s` (the servers' header timeout, which rightly closes a client that silent),
           or a client timeout while it was stalled for half its connect timeout or more (its own timers
           fire before it reads what arrived). Only those two qualify; a bad answer (5xx without a code,
           truncated 200) is untyped whatever the stall.

Each record carries `t0` and `t1` (wall clock at the start of the request's first attempt and at its
end: t1 - t0 is its end-to-end latency), `ft` (streams: seconds from t0 to the first token) and `p` (the
router's `X-PDGate-Path` header when it sent one: `whole` is an answer served without disaggregation), so
the orchestrator can compare latency before and during a fault.

The process measures its own event-loop stalls (a 0.1 s ticker) and writes the worst of them to the last
line of `--out` as `{"lag": ...}` (not a request record).

With `--failover` (several `--url`s, client-side round robin), a request whose connection fails is sent
again to the next router, as a client of two routers would; only its final outcome is recorded, with the
number of such retries.

The load stops when `--stop-file` appears or `--duration` has passed, whichever comes first; each request
has a client-side timeout, so the process always ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

import httpx
import openai

from pdgate.errors import Code

__all__ = ["PATH_HEADER", "TYPED_CODES", "classify_exception", "main"]

TYPED_CODES = frozenset(c.value for c in Code)
PATH_HEADER = "x-pdgate-path"  # how the router served a request; "whole" when it did not disaggregate
_CLIENT_SIDE = ("connection:", "client timeout")  # failures a stalled client can cause by itself
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def _prompt(worker: int, seq: int) -> str:
    words = [_WORDS[(worker * 7 + seq + i) % len(_WORDS)] for i in range(24)]
    return f"chaos client {worker} request {seq}: " + " ".join(words)


def classify_exception(exc: BaseException) -> tuple[str, str | None, int | None, str]:
    """(outcome, code, status, detail) of a request that raised."""
    if isinstance(exc, openai.APIStatusError):
        code = _code_of(exc.body)
        typed = code in TYPED_CODES
        return ("typed" if typed else "untyped", code, exc.status_code, str(exc)[:200])
    if isinstance(exc, openai.APITimeoutError):
        return ("untyped", None, None, "client timeout")
    if isinstance(exc, openai.APIConnectionError):
        return ("untyped", None, None, f"connection: {exc.__cause__!r}"[:200])
    if isinstance(exc, openai.APIError):  # an SSE error event in the middle of a stream
        code = _code_of(exc.body)
        return ("typed" if code in TYPED_CODES else "untyped", code, 200, str(exc)[:200])
    return ("untyped", None, None, f"{type(exc).__name__}: {exc}"[:200])


def _code_of(body: object) -> str | None:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("code"), str):
            return str(inner["code"])
    return None


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.urls: list[str] = args.url
        limits = httpx.Limits(max_connections=args.streams + 64, max_keepalive_connections=args.streams + 64)
        timeout = httpx.Timeout(args.request_timeout, connect=args.connect_timeout)
        self.http = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.clients = [
            openai.AsyncOpenAI(
                base_url=u.rstrip("/") + "/v1", api_key="chaos", max_retries=0, http_client=self.http, timeout=timeout
            )
            for u in self.urls
        ]
        self.end = time.time() + args.duration
        self.stop_file = Path(args.stop_file) if args.stop_file else None
        self.out: TextIO = open(args.out, "w", buffering=1)
        self.rr = 0
        self.stalls: list[tuple[float, float]] = []  # (end, length) of each event-loop stall over 0.5 s
        self.worst_stall = 0.0

    async def watch_stalls(self) -> None:
        """Record when this process's own event loop did not run (CPU starvation, SIGSTOP)."""
        tick = 0.1
        while not self.stopping():
            t = time.monotonic()
            await asyncio.sleep(tick)
            late = time.monotonic() - t - tick
            self.worst_stall = max(self.worst_stall, late)
            if late > 0.5:
                self.stalls.append((time.time(), late))

    def stalled_during(self, t0: float, t1: float) -> float:
        """The longest stall of this process that overlapped [t0, t1] (wall clock)."""
        return max((n for end, n in self.stalls if end >= t0 and end - n <= t1), default=0.0)

    def stopping(self) -> bool:
        return time.time() >= self.end or (self.stop_file is not None and self.stop_file.exists())

    def record(self, rec: dict[str, Any]) -> None:
        self.out.write(json.dumps(rec, separators=(",", ":")) + "\n")

    async def _once(
        self, client: openai.AsyncOpenAI, prompt: str, stream: bool
    ) -> tuple[str, str | None, str, float | None, str | None]:
        """(outcome, code, detail, wall clock of the first token, the router's X-PDGate-Path) of one answer."""
        n, finish = 0, None
        first: float | None = None
        create = client.completions.with_raw_response.create
        if stream:
            raw = await create(model=self.a.model, prompt=prompt, max_tokens=self.a.max_tokens, stream=True)
            path = raw.headers.get(PATH_HEADER)
            async for chunk in raw.parse():
                for c in chunk.choices:
                    if c.text and first is None:
                        first = time.time()
                    n += 1 if c.text else 0
                    finish = c.finish_reason or finish
        else:
            answer = await create(model=self.a.model, prompt=prompt, max_tokens=self.a.max_tokens)
            path = answer.headers.get(PATH_HEADER)
            full = answer.parse()
            if full.choices:
                n = full.usage.completion_tokens if full.usage else len(full.choices[0].text.split())
                finish = full.choices[0].finish_reason
        if finish is None or n < self.a.max_tokens:
            return ("untyped", None, f"truncated 200: {n} tokens, finish_reason {finish}", first, path)
        return ("ok", None, "", first, path)

    async def request(self, worker: int, seq: int, stream: bool) -> None:
        t0 = time.time()
        # A client of several routers goes round them, twice, with a short pause between rounds.
        tries = 2 * len(self.clients) if self.a.failover else 1
        first = self.rr
        self.rr += 1
        outcome: tuple[str, str | None, int | None, str] = ("untyped", None, None, "not sent")
        first_token: float | None = None
        path: str | None = None
        retries = 0
        failed_on: list[int] = []
        for attempt in range(tries):
            which = (first + attempt) % len(self.clients)
            client = self.clients[which]
            if attempt and which == first % len(self.clients):
                await asyncio.sleep(0.2)
            try:
                kind, code, detail, first_token, path = await self._once(client, _prompt(worker, seq), stream)
                outcome = (kind, code, 200, detail)
            except Exception as exc:
                outcome = classify_exception(exc)
                if isinstance(exc, openai.APIConnectionError):
                    failed_on.append(which)
                    if attempt + 1 < tries:
                        retries += 1
                        continue
            break
        kind, code, status, detail = outcome
        stalled = self.stalled_during(t0, time.time())
        # A stall past the servers' header timeout explains a connection they closed; a stall of half the
        # client's own (shortest, connect) timeout explains a timeout of its own: it had no fair chance.
        bound = self.a.client_stall_s if detail.startswith("connection:") else self.a.connect_timeout / 2
        if kind == "untyped" and detail.startswith(_CLIENT_SIDE) and stalled >= bound:
            kind, detail = "client", f"{detail} (this client stalled {stalled:.1f} s)"
        rec = {"t0": round(t0, 4), "t1": round(time.time(), 4), "s": int(stream), "o": kind, "c": code}
        if status is not None and status != 200:
            rec["st"] = status
        if kind != "ok":
            rec["d"] = detail
        if first_token is not None:
            rec["ft"] = round(first_token - t0, 4)  # time to first token (streams), from the first attempt
        if path:
            rec["p"] = path  # the router's X-PDGate-Path ("whole": served without disaggregation)
        if retries:
            rec["r"] = retries
        if failed_on:
            rec["f"] = failed_on  # which routers refused or broke the connection, in order
        self.record(rec)

    async def streamer(self, worker: int) -> None:
        # Spread the starts (over a second by default) so the fault does not meet a lock-step wave.
        await asyncio.sleep(self.a.ramp_s * worker / max(1, self.a.streams))
        seq = 0
        while not self.stopping() and seq < self.a.max_per_worker:
            await self.request(worker, seq, True)
            seq += 1

    async def trickle(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        seq = 0
        period = 1.0 / self.a.trickle if self.a.trickle > 0 else None
        while period is not None and not self.stopping() and seq < self.a.max_per_worker * 10:
            if len(tasks) < 32:
                t = asyncio.create_task(self.request(-1, seq, False))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            seq += 1
            await asyncio.sleep(period)
        if tasks:
            await asyncio.gather(*tasks)

    async def run(self) -> None:
        watcher = asyncio.create_task(self.watch_stalls())
        try:
            await asyncio.gather(*(self.streamer(i) for i in range(self.a.streams)), self.trickle())
        finally:
            watcher.cancel()
            self.out.write(json.dumps({"lag": round(self.worst_stall, 3), "stalls": len(self.stalls)}) + "\n")
            self.out.close()
            await self.http.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--url", action="append", required=True, help="router base URL (repeat for round robin)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--trickle", type=float, default=2.0, help="non-streaming requests per second")
    p.add_argument("--duration", type=float, default=60.0, help="hard cap in seconds")
    p.add_argument("--stop-file", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="sim-model")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--max-per-worker", type=int, default=100_000)
    p.add_argument("--failover", action="store_true")
    p.add_argument("--ramp-s", type=float, default=1.0, help="start the streaming clients over this long")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument(
        "--client-stall-s",
        type=float,
        default=30.0,
        help="a connection error during a stall of this process longer than this is the client's (the "
        "servers' header timeout)",
    )
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    os.environ.setdefault("OPENAI_LOG", "error")
    asyncio.run(Load(args).run())


if __name__ == "__main__":
    main()

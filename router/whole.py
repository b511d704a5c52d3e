"""Whole requests: one instance serves a request end to end, without disaggregation (issue #22 item 2, #24).

A request goes whole:
- when the flow chooses it up front (`Whole.choose`, the one place where "whole or PD" is decided and
  where a decider plugs in): the ledger is known to be down (`Pool.ledger_down`) and
  `--on-ledger-outage serve-whole`, or `--both-path whole` and the model's only prefills are of role both
  (a colocated pool);
- when PD failed before a byte reached the client (`Whole.fallback`): the metaserver or its store could
  not record the handoff, no prefill/decode pair is live, or every prefill or decode attempt failed.
  A handoff still live is aborted first; the instance the last decode attempt used is skipped.
A request the decider keeps whole (`--disaggregation conditional|never`) runs on whichever instance of
either side the decode policy picks (`--whole-on any`, the default): on a 1P1D pool the prefill's core
would otherwise sit idle while short prompts queue on the decode; `--whole-on decode` keeps the prefills
for PD prompts. A PD request that failed goes to a decode first, a prefill only when no decode is live
(`Pool.whole_candidates`): the prefill is where it may just have failed. The instance gets
the client's body as it is, so its answer is the one instance's answer token for token. The answer says
`X-PDGate-Path: whole`; `pdgate_router_undisaggregated_total{reason}` counts it.

A stream that breaks after its first byte (the engine died, stalled past `--stream-idle-timeout-s`, or
sent its error event) is resumed here too (`Whole.resume`, `resume` for the pure parts): the rest of the
request goes whole to another instance, up to `--max-resumes` times, and the client reads one stream.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from random import Random
from time import perf_counter

import orjson
from pdgate.router.bodies import COMPLETIONS, RequestFacts
from pdgate.router.decider import PATH_REASONS, Path, config_from, decide_early, decide_request
from pdgate.router.engine_call import Answer, open_answer
from pdgate.router.errors import (
    DecodeFailed,
    NoCompatiblePair,
    PDError,
    RouterError,
    UpstreamRejected,
    Where,
    detail,
    failed,
    snippet,
)
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Policy, load_of
from pdgate.router.pool import Lease, LiveInstance, Pool
from pdgate.router.request_flow import ProxiedRequest
from pdgate.router.resume import Continuation, continuation_body
from pdgate.router.retry import Verdict, retry_elsewhere
from pdgate.router.settings import RouterSettings
from pdgate.router.streaming import end_stream, relay_stream, send_body

from pdgate.asgi import Send, add_access_note
from pdgate.errors import Code, PDGateError
from pdgate.models import Role
from pdgate.upstream import Upstream

__all__ = ["PATH_HEADER", "Whole"]

log = logging.getLogger("pdgate.router.proxy")

PATH_HEADER = (b"x-pdgate-path", b"whole")
_JSON = b"application/json"
# PD failures, before the client saw a byte, that another instance can serve whole.
_PD_FAILURES = {
    Code.METASERVER_UNAVAILABLE: "ledger_unavailable",
    Code.NO_COMPATIBLE_PAIR: "no_pair",
    Code.PREFILL_FAILED: "pd_failed",
    Code.DECODE_FAILED: "pd_failed",
    Code.KV_EXPIRED: "pd_failed",
    Code.UPSTREAM_TIMEOUT: "pd_failed",
    Code.NO_INSTANCE: "pd_failed",
    # The prefill answered, its READY never reached this router's ledger (another metaserver, a refused
    # token): the prompt is computed again whole, and the log and the counter name why.
    Code.KV_NOT_READY: "kv_not_ready",
}
_LEDGER_REASONS = ("ledger_unavailable", "no_pair")
# The decider's reasons for whole: with `--whole-on any` these run on either side (`Pool.whole_candidates`).
_DECIDED = frozenset(reason.value for path, reason in PATH_REASONS if path is Path.WHOLE)
# Each decision's access-log note, formatted once (`pd:long_prompt`), not per request.
_NOTES = {(path, reason): f"{path.value}:{reason.value}" for path, reason in PATH_REASONS}

Headers = Callable[[ProxiedRequest, LiveInstance], list[tuple[bytes, bytes]]]


class Whole:
    """Serves requests end to end on one instance, and resumes broken streams; one per router."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        pool: Pool,
        upstream: Callable[[], Upstream],
        metrics: RouterMetrics,
        headers: Headers,
        pause: Callable[[int], Awaitable[None]],
        clock: Callable[[], float],
        rng: Random,
        cached_tokens: Callable[[LiveInstance, RequestFacts], int] | None = None,
        policy: Policy | None = None,
        prefill_policy: Policy | None = None,
    ) -> None:
        s = settings
        self._decider = config_from(s)
        self._cached = cached_tokens  # the decode's cached prefix (KV events: CacheAware.cached_tokens)
        self._policy = policy  # picks among either side's instances for the decider's whole requests
        self._p_policy = prefill_policy  # the PD path's prefill pick, made once here (`req.prefill_at`)
        self._either = s.whole_on == "any"
        self._pool = pool
        self._upstream = upstream
        self._m = metrics
        self._headers = headers
        self._pause = pause
        self._clock = clock
        self._rng = rng
        self._on_outage = s.on_ledger_outage == "serve-whole"
        self._both_whole = s.both_path == "whole"
        self._on_failure = s.whole_on_failure
        self._tries = 1 + s.decode_retries
        self._timeout = s.decode_timeout_s
        self._idle = s.stream_idle_timeout_s
        self._max_resumes = s.max_resumes

    # -- whole or PD ------------------------------------------------------------------------

    def choose(self, req: ProxiedRequest, model: str) -> str | None:
        """Why `req` goes whole from the start, or None for PD: the entry point of the decision."""
        if self._on_outage and self._pool.ledger_down:
            return "ledger_unavailable"
        if self._both_whole:
            cands = self._pool.prefill_candidates(model, self._clock())
            if cands and all(p.view.role is Role.BOTH for p in cands):
                return "colocated"
        if self._decider.mode != "always":
            return self._decide(req, model)
        return None

    def _decide(self, req: ProxiedRequest, model: str) -> str | None:
        """`--disaggregation conditional|never`: the decider (router/decider.py) over the prefill the PD path
        would use and the instance the request would run whole on; counted by reason. The picks are made
        once: PD's first attempt takes them (`req.prefill_at`, and `req.whole_at` as its decode when it is
        one that pairs), so the decode whose cache was weighed is the one that pulls the KV, and a request
        costs no more policy calls than without the decider; the prefill is picked only when the rules that
        need no pick (`decide_early`) leave the request undecided. With no instance to ask, PD's own path
        names the error."""
        now = self._clock()
        prefills = self._pool.prefill_candidates(model, now)
        # Weighed on the instance the request would run whole on (with KV events, the one holding the most of
        # its prefix, a prefill included under --whole-on any): a conversation's turn kept whole on a prefill
        # is weighed there next turn, not on a decode that holds none of it.
        where = self._whole_pick(req, model, now, (), either=self._either)
        if where is None:
            return None
        req.whole_at = where  # the policies keep state (round robin's turn): chosen once, run there first
        ledger_ok = not self._pool.ledger_down
        prompt = req.facts.prompt_tokens
        decision = decide_early(
            self._decider, prompt, where.id, has_prefill=bool(prefills), ledger_ok=ledger_ok, slo=req.slo
        )
        if decision is None:  # the prefill's pick and the decode's cache count: a request kept whole asks neither
            if self._p_policy is None:
                prefill = min(prefills, key=load_of)
            else:
                prefill = prefills[self._p_policy.choose(prefills, req.facts, self._rng) or 0]
            req.prefill_at = prefill
            decision = decide_request(
                self._decider, req.facts, where, prefill, cached_tokens=self._cached, ledger_ok=ledger_ok, slo=req.slo
            )
        self._m.decision(decision.labels)
        if req.notes is not None:
            add_access_note(req.notes, _NOTES[decision.path, decision.reason])
        return None if decision.path is Path.PD else decision.reason.value

    def _whole_pick(
        self, req: ProxiedRequest, model: str, now: float, skip: Sequence[str], *, either: bool
    ) -> LiveInstance | None:
        """Where the decider's whole request runs: the decode policy's choice (the least loaded, or with KV
        events the instance holding its prefix) among the decodes, or either side's instances."""
        cands = self._pool.whole_candidates(model, now, skip, either=either)
        if not cands:
            return None
        if self._policy is None:
            return min(cands, key=load_of)
        at = self._policy.choose(cands, req.facts, self._rng)
        return cands[at] if at is not None else None

    def fallback(self, req: ProxiedRequest, exc: RouterError) -> str | None:
        """Why `req`, whose PD attempts failed with `exc` before a byte reached the client, goes whole; None:
        the client gets `exc` (its own 4xx, or `--on-ledger-outage refuse` for the ledger's failures)."""
        if req.started or not isinstance(exc, PDError):
            return None
        reason = _PD_FAILURES.get(exc.code)
        on = self._on_outage if reason in _LEDGER_REASONS else self._on_failure
        return reason if on else None

    async def serve(
        self, req: ProxiedRequest, model: str, send: Send, reason: str, cause: RouterError | None = None
    ) -> str:
        """Serve `req` end to end on an instance; returns its outcome label. An instance whose PD attempt
        failed is not asked again; when none is left, `cause` (PD's failure) is the client's error."""
        if cause is not None and not self._pool.whole_candidates(model, self._clock(), req.tried):
            raise cause
        self._m.undisaggregated.labels(reason).inc()
        log.info("serving whole (%s)", reason)
        if req.notes is not None and reason not in _DECIDED:  # the decider's reasons are noted when decided
            add_access_note(req.notes, f"whole:{reason}")
        skip = req.tried
        body = {k: v for k, v in req.body.items() if k != "kv_transfer_params"}
        payload = orjson.dumps(body)
        # The decider kept it whole: any instance may run it, chosen by the decode policy (the least loaded,
        # or with KV events the one holding its prefix). A failed PD request: a decode, the least loaded.
        decided = reason in _DECIDED

        async def pick(tried: Sequence[str]) -> LiveInstance | None:
            now = self._clock()
            if not decided:
                cands = self._pool.whole_candidates(model, now, [*skip, *tried])
                return min(cands, key=load_of) if cands else None
            at = req.whole_at
            if at is not None and at.id not in skip and at.id not in tried and at.unavailable(now) is None:
                return at
            return self._whole_pick(req, model, now, [*skip, *tried], either=self._either)

        def none_left() -> PDGateError:
            now = self._clock()
            return NoCompatiblePair(
                f"no instance can serve the request: {self._pool.explain(model, now, public=True)}",
                detail=f"no instance can serve the request: {self._pool.explain(model, now)}",
            )

        return await retry_elsewhere(
            "whole",
            self._tries,
            pick,
            lambda i: self._once(req, i, send, payload, req.endpoint),
            none_left,
            self._pause,
        )

    async def _open(
        self, req: ProxiedRequest, inst: LiveInstance, lease: Lease, path: str, body: bytes, *, stream: bool
    ) -> Answer:
        """One engine call of the whole path (a request, or a stream's continuation); a call that raises
        counts against the instance."""
        try:
            return await open_answer(
                self._upstream(),
                inst.view.url + path,
                self._headers(req, inst),
                body,
                stream=stream,
                timeout=self._timeout,
                idle_timeout=self._idle,
                where=Where(*inst.where("instance")),
                ttft=self._m.decode_ttft,
            )
        except Exception:
            lease.failed()
            raise

    async def _once(self, req: ProxiedRequest, inst: LiveInstance, send: Send, payload: bytes, endpoint: str) -> str:
        where = Where(*inst.where("instance"))
        stream = req.facts.stream
        with self._pool.lease(inst, req.facts.prompt_tokens + req.facts.max_tokens, self._clock) as lease:
            ans = await self._open(req, inst, lease, endpoint, payload, stream=stream)
            resp = ans.resp
            try:
                if ans.verdict == Verdict.REJECTED:
                    lease.succeeded()
                    raise UpstreamRejected(resp.status, ans.data or b"", resp.header(b"content-type"))
                if ans.verdict != Verdict.OK:
                    lease.failed()
                    raise failed(DecodeFailed, where, f"answered {resp.status}", snippet(ans.data or b""))
                ctype = resp.header(b"content-type") or _JSON
                headers = [(b"content-type", ctype), (b"x-request-id", req.rid), PATH_HEADER]
                req.started = True
                if not stream:
                    lease.succeeded()
                    await send_body(send, resp.status, headers, ans.data or b"", req.end)
                    return "ok"
                track = req.track
                error = await relay_stream(
                    send, resp, ans.data, headers, self._idle, req.end, where, resumable=track is not None
                )
                if error is None:
                    lease.succeeded()
                    return "ok"
                lease.failed()
            finally:
                resp.close()
        return await self.resume(req, error, [inst.id])

    # -- resuming a broken stream -------------------------------------------------------------

    async def resume(self, req: ProxiedRequest, error: RouterError, exclude: list[str]) -> str:
        """Go on with `req`'s stream, broken by `error`, on another instance (module doc); returns the
        request's outcome. Ends the stream with `error` when it cannot be resumed."""
        track = req.track
        assert track is not None
        model = req.facts.model or (req.prefill.view.model if req.prefill is not None else None)
        while True:
            pending = track.pending()
            if not pending:  # every choice finished: only the end of the stream was lost
                req.end()
                await track({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                return "ok"
            cands = self._pool.whole_candidates(model, self._clock(), exclude) if model is not None else []
            if req.resumes >= self._max_resumes or not track.can_resume() or not cands:
                self._m.error(error.code.value)
                log.warning("%s after the stream started: %s", error.code.value, detail(error))
                await end_stream(track, error, req.end)
                return error.code.value
            req.resumes += 1
            self._m.resumes.labels(error.code.value).inc()
            log.warning(
                "%s after %d tokens: resuming %d choice(s) (%s)",
                error.code.value,
                track.received() + track.given,  # the answer's tokens the client got, the prefill's first too
                len(pending),
                detail(error),
            )
            t = perf_counter()
            for k, index in enumerate(pending):
                inst = cands[self._rng.randrange(len(cands))]
                cont = Continuation(track, index, last=k == len(pending) - 1)
                body = orjson.dumps(continuation_body(req.body, track, index))
                try:
                    next_error = await self._continue(req, inst, cont, body)
                except RouterError as exc:
                    next_error = exc
                if cont.first_at is not None:
                    log.info("resumed on %s: %.3f s from the break to its first token", inst.id, cont.first_at - t)
                if next_error is not None:
                    exclude.append(inst.id)
                    error = next_error
                    break
            else:
                return "ok"

    async def _continue(
        self, req: ProxiedRequest, inst: LiveInstance, cont: Continuation, body: bytes
    ) -> RouterError | None:
        where = Where(*inst.where("instance"))
        with self._pool.lease(inst, req.facts.prompt_tokens + req.facts.max_tokens, self._clock) as lease:
            ans = await self._open(req, inst, lease, COMPLETIONS, body, stream=True)
            resp = ans.resp
            try:
                if ans.verdict != Verdict.OK:
                    if ans.verdict == Verdict.FAILED:
                        lease.failed()
                    return failed(DecodeFailed, where, f"answered {resp.status}", snippet(ans.data or b""))
                end = req.end if cont.last else _later
                error = await relay_stream(cont, resp, ans.data, [], self._idle, end, where, resumable=True)
                if error is None:
                    lease.succeeded()
                else:
                    lease.failed()
                return error
            finally:
                resp.close()


def _later() -> None:
    """The end of a choice's continuation that other choices' continuations follow: not the stream's end."""

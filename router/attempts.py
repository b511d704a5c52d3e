"""The prefill and decode of one proxied request, each tried on instance after instance (`Dispatcher`).

A prefill attempt owns a fresh handoff (created when its instance is picked, aborted when the attempt
fails); decode attempts reuse the prefill's handoff. Both sides run through `retry.retry_elsewhere`,
so what is retried is decided in one place, by the error's `retryable`.

Before a decode attempt is sent, the router claims the handoff in the ledger for that decode and passes
the claim in its `kv_transfer_params` (`contract.with_claim`), so the decode pulls at once with no
metaserver round trip of its own (`_claim_for`: waits while the prefill's READY is on its way; takes back
the claim of a decode an earlier attempt gave up on; without a claim, e.g. the metaserver unreachable,
the decode claims by itself as a decode reached directly does).

A decode attempt ends only once its answer has been judged, so that a bad answer is still retried on
another decode while nothing has been sent to the client:
- a JSON answer is read whole and must be a JSON object before the status line goes out: an empty
  body, a connection that closes early or a body that does not parse is `pd_decode_failed`;
- a stream must be `text/event-stream`; it is relayed from its first bytes on, after which a failure
  is reported in the stream (`streaming.relay_stream`) and never retried.
Any exception while connecting to, writing to or reading from an instance is that instance's failure
(`errors.UPSTREAM_FAILURES`): it counts against its breaker and the next instance is tried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from random import Random
from time import perf_counter

import orjson
from pdgate.router import first_token
from pdgate.router.answers import same_location, unusable
from pdgate.router.bodies import SplicedBody, decode_params, kv_params_from_prefill, prefill_params, with_fields
from pdgate.router.engine_call import open_answer
from pdgate.router.errors import (
    META_FAILURES,
    UPSTREAM_FAILURES,
    DecodeFailed,
    KVExpired,
    KVNotReady,
    NoCompatiblePair,
    PrefillFailed,
    RouterError,
    UpstreamRejected,
    Where,
    detail,
    failed,
    snippet,
    translate,
)
from pdgate.router.loops import HOP_HEADER, HOP_VALUE
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Policy
from pdgate.router.pool import LiveInstance, Pool
from pdgate.router.request_flow import MAX_ANSWER, ProxiedRequest, mint_transfer_id
from pdgate.router.retry import Verdict, backoff, retry_elsewhere, verdict
from pdgate.router.settings import RouterSettings
from pdgate.router.stall import FirstByteClock
from pdgate.router.streaming import relay_stream, send_body

from pdgate.asgi import Send
from pdgate.claim_wait import ClaimRefused, ClaimRule, claim_handoff
from pdgate.contract import InvalidTransferParams, KVTransferParams, RouterClaim, with_claim
from pdgate.errors import Code, PDGateError
from pdgate.logs import transfer_id as log_transfer_id
from pdgate.meta_client import MetaAPI, MetaConflict, MetaError, MetaGone, MetaNotFound
from pdgate.models import Handoff, HandoffCreate, HandoffState
from pdgate.upstream import Upstream, UpstreamResponse

__all__ = ["Dispatcher"]

log = logging.getLogger("pdgate.router.proxy")

_CREATE_TRIES = 3  # creates of one handoff before a taken transfer id is reported as a failure
_CLAIM_WAIT_S = 5.0  # how long a decode attempt waits to claim (READY on its way) before it goes unclaimed
_RELEASE_LEASE_S = 0.001  # the lease a claim taken back is shortened to: the sweeper requeues it at once
_RELEASE_POLL_S = 0.02
_JSON = b"application/json"


class Dispatcher:
    """Sends a request's prefill and decode copies to engines; one per router, state per request in
    the `ProxiedRequest` it is handed."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        pool: Pool,
        meta: Callable[[], MetaAPI],
        upstream: Callable[[], Upstream],
        metrics: RouterMetrics,
        prefill_policy: Policy,
        decode_policy: Policy,
        engine_metaserver: str | None,
        rng: Random,
        clock: Callable[[], float],
        claim_key: bytes | None = None,
    ) -> None:
        s = settings
        self._claim_key = claim_key  # seals each claim for its decode (pdgate.claim_seal)
        self._pool = pool
        self._meta = meta
        self._upstream = upstream
        self._m = metrics
        self._p_policy = prefill_policy
        self._d_policy = decode_policy
        self._engine_meta = engine_metaserver
        self._rng = rng
        self._clock = clock
        self._upstream_auth = f"Bearer {s.upstream_api_key}".encode() if s.upstream_api_key else None
        self._p_tries = 1 + s.prefill_retries
        self._d_tries = 1 + s.decode_retries
        self._backoff = (s.retry_backoff_s, s.retry_backoff_max_s)
        self._p_timeout = s.prefill_timeout_s
        self._d_timeout = s.decode_timeout_s
        self._first_byte = FirstByteClock(s.decode_timeout_s, s.first_byte_floor_s, s.first_byte_factor)
        self._idle_timeout = s.stream_idle_timeout_s
        self._lease_s = s.handoff_lease_s
        self._bg: set[asyncio.Task[None]] = set()
        self._p_retries = metrics.retries.labels("prefill")
        self._d_retries = metrics.retries.labels("decode")
        # Goes on with a stream that broke after its first byte (`whole.Whole.resume`; set by the proxy).
        self.resume: Callable[[ProxiedRequest, RouterError, list[str]], Awaitable[str]] | None = None

    def headers(self, req: ProxiedRequest, inst: LiveInstance) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", _JSON), (b"x-request-id", req.rid)]
        v = inst.view
        if v.dp_size > 1:
            h.append((b"x-data-parallel-rank", str(v.dp_rank).encode()))
        if self._upstream_auth is not None:
            h.append((b"authorization", self._upstream_auth))
        elif req.client_auth is not None:  # set only with --forward-client-auth
            h.append((b"authorization", req.client_auth))
        h.append((HOP_HEADER, HOP_VALUE))
        if req.extra:
            h.extend(req.extra)
        return h

    async def pause(self, attempt: int) -> None:
        base, cap = self._backoff
        if base > 0:
            await asyncio.sleep(backoff(attempt, base, cap, self._rng))

    # -- prefill --------------------------------------------------------------------------------

    async def prefill(self, req: ProxiedRequest, model: str) -> None:
        """Prefill on some instance; on return `req.prefill`, `req.live` and `req.decode_kv` are set."""

        async def pick(tried: Sequence[str]) -> LiveInstance | None:
            cands = self._pool.prefill_candidates(model, self._clock(), tried)
            if not cands:
                return None
            p = req.prefill_at  # the decider's pick (`Whole._decide`), while it is still a candidate
            if p is None or tried or p not in cands:
                p = cands[self._p_policy.choose(cands, req.facts, self._rng) or 0]
            if tried:
                self._p_retries.inc()
                req.tid = mint_transfer_id()
                log_transfer_id.set(req.tid)
            await self._create_handoff(req, p)
            return p

        def none_left() -> PDGateError:
            now = self._clock()
            return NoCompatiblePair(self._pool.explain(model, now, public=True), detail=self._pool.explain(model, now))

        async def attempt(p: LiveInstance) -> None:
            try:
                await self._prefill_once(req, p)
            except PDGateError:
                req.tried.append(p.id)
                raise

        await retry_elsewhere("prefill", self._p_tries, pick, attempt, none_left, self.pause)

    async def _create_handoff(self, req: ProxiedRequest, p: LiveInstance) -> None:
        t = perf_counter()
        for fresh in range(_CREATE_TRIES):
            if fresh:  # someone holds this id (squatted or, at 2**-128, a collision): draw another
                req.tid = mint_transfer_id()
                log_transfer_id.set(req.tid)
            try:
                h = await self._meta().create_handoff(
                    HandoffCreate(
                        prefill_instance_id=p.id,
                        transfer_id=req.tid,
                        lease_s=self._lease_s,
                        request_id=req.rid[:512].decode("latin-1"),
                    )
                )
                break
            except MetaConflict as exc:
                if exc.code != Code.HANDOFF_EXISTS.value or fresh + 1 == _CREATE_TRIES:
                    raise translate(exc, META_FAILURES, "cannot record the handoff") from exc
                log.warning("transfer id %s already exists in the ledger; retrying with a fresh id", req.tid)
            except MetaError as exc:
                raise translate(exc, META_FAILURES, "cannot record the handoff") from exc
        req.kv_key = h.kv_key
        req.live = req.tid
        self._m.handoff.observe(perf_counter() - t)

    async def _prefill_once(self, req: ProxiedRequest, p: LiveInstance) -> None:
        if req.spliced is None:  # once per request: retries and the decode splice onto the same encoding
            req.spliced = SplicedBody(req.body)
        payload = req.spliced.prefill(prefill_params(req.tid, req.kv_key, self._engine_meta), token_ids=req.first_token)
        try:
            await self.send_prefill(req, p, payload, partial(self._take_answer, req))
        except UpstreamRejected:
            req.abort_reason = "prefill_rejected"
            raise
        except PDGateError as exc:
            if exc.retryable:  # this attempt's handoff dies with it; a retry creates its own
                self.abort(req, "prefill_failed")
            raise
        req.prefill = p

    async def send_prefill(
        self, req: ProxiedRequest, p: LiveInstance, payload: bytes, take: Callable[[bytes], None] | None = None
    ) -> None:
        """POST a prefill copy to `p`, judged under its lease: the one prefill call of the ledger protocol and
        of stock Mooncake, so what counts against a prefill's breaker is decided once. What `take` (given
        the 2xx body) raises is the prefill's failure; a 4xx is the request's (`UpstreamRejected`)."""
        where = Where(*p.where("prefill"))
        t = perf_counter()
        try:
            with self._pool.lease(p, req.facts.prompt_tokens, self._clock) as lease:
                resp: UpstreamResponse | None = None
                try:
                    resp = await self._upstream().request(
                        "POST", p.view.url + req.endpoint, self.headers(req, p), payload, timeout=self._p_timeout
                    )
                    data = await resp.read(timeout=self._p_timeout, limit=MAX_ANSWER)
                except Exception as exc:
                    lease.failed()
                    raise translate(exc, UPSTREAM_FAILURES["prefill"], where) from exc
                finally:
                    if resp is not None:
                        resp.close()
                v = verdict(resp.status)
                if v == Verdict.OK:
                    try:
                        if take is not None:
                            take(data)
                    except Exception as exc:  # the prefill's answer cannot be decoded from: its failure
                        lease.failed()
                        raise failed(PrefillFailed, where, *unusable(exc)) from exc
                    lease.succeeded()
                    return
                if v == Verdict.REJECTED:
                    lease.succeeded()  # the request's fault, not the instance's
                    raise UpstreamRejected(resp.status, data, resp.header(b"content-type"))
                lease.failed()
                raise failed(PrefillFailed, where, f"answered {resp.status}", snippet(data))
        finally:
            self._m.prefill.observe(perf_counter() - t)

    def _take_answer(self, req: ProxiedRequest, data: bytes) -> None:
        """Check the prefill's answer in full and keep what the decode and the client's answer take from
        it. Anything wrong in it (a field `KVTransferParams.parse` refuses, a `kv_key` other than the
        handoff's, a first token `first_token.check` refuses) raises here, while the client has seen
        nothing: the caller makes it this prefill's failure, counted by its breaker and retried on
        another prefill."""
        req.prefill_answer, params = kv_params_from_prefill(data)
        kv = req.prefill_kv = KVTransferParams.parse(params)
        if kv.kv_key is not None and kv.kv_key != req.kv_key:
            raise InvalidTransferParams("kv_transfer_params.kv_key is not the handoff's")
        # Only a prefill that names the handoff records READY in the ledger (pdgate's connector, the
        # simulator); vLLM's stock NixlConnector does not: no claim then.
        req.ledger_prefill = kv.transfer_id == req.tid
        if req.first_token:
            first_token.check(req.prefill_answer, req.body.get("prompt"))
        req.decode_kv = decode_params(params, req.tid, req.kv_key, self._engine_meta)
        # Encoded once; fails here, not later. Without `remote_location`: each attempt adds the one the
        # ledger holds for its claim (`_sealed_claim`), else the prefill's hint.
        req.decode_kv_json = orjson.dumps({k: v for k, v in req.decode_kv.items() if k != "remote_location"})

    # -- decode ---------------------------------------------------------------------------------

    async def decode(self, req: ProxiedRequest, send: Send) -> str:
        """Decode on some instance and answer the client; returns the request's outcome label."""
        prefill = req.prefill
        assert prefill is not None
        req.abort_reason = "decode_failed"  # unless an attempt says more precisely

        async def pick(tried: Sequence[str]) -> LiveInstance | None:
            cands = self._pool.decode_candidates(prefill, self._clock(), tried)
            if not cands:
                return None
            if tried:
                self._d_retries.inc()
            elif req.whole_at is not None and req.whole_at in cands:  # the decode the decider weighed
                return req.whole_at
            return cands[self._d_policy.choose(cands, req.facts, self._rng) or 0]

        def none_left() -> PDGateError:
            model, now = prefill.view.model or "?", self._clock()
            public, internal = prefill.where("prefill")
            why = self._pool.explain(model, now, public=True)
            return NoCompatiblePair(
                f"no available decode can take the KV of {public}: {why}",
                detail=f"no available decode can take the KV of {internal}: {self._pool.explain(model, now)}",
            )

        failures: list[PDGateError] = []

        async def attempt(d: LiveInstance) -> str:
            try:
                return await self._decode_once(req, d, send)
            except PDGateError as exc:
                failures.append(exc)
                req.tried.append(d.id)
                raise

        try:
            return await retry_elsewhere("decode", self._d_tries, pick, attempt, none_left, self.pause)
        except KVExpired as exc:
            if len(failures) < 2:
                raise
            # The decode that failed first had claimed the KV: the retry could only find it gone. The
            # client is told what went wrong, not what the retry found.
            first = failures[0]
            raise DecodeFailed(
                f"{first.message}; a retry found the KV gone", detail=f"{detail(first)}; a retry found the KV gone"
            ) from exc

    async def _claim_for(self, req: ProxiedRequest, d: LiveInstance) -> RouterClaim | None:
        """Claim the handoff for decode `d`; None when it cannot be done now (the decode claims itself) or
        the prefill does not record READY in the ledger (vLLM's stock connectors: nothing to claim).

        While PENDING (the prefill's READY is on its way) it long-polls the record. When the decode of an
        earlier attempt holds the claim, the router gave up on that decode's answer, so it takes the claim
        back: it renews it in that decode's name with a lease of a millisecond, the sweeper returns the
        record to READY (keeping the claims count, so `max_claims` still bounds a record), and `d` claims
        it. Gone (410) is the request's end: the KV expired or was aborted. The rule is `pdgate.claim_wait`'s,
        the one the decodes follow; only the router passes a `holder` to take back. Still PENDING when the
        wait ends is the request's end too (`KVNotReady.never_ready`).
        """
        if not req.ledger_prefill:
            return None
        prev = req.last_decode  # the earlier attempt's decode: the only claim the router takes back
        rule = ClaimRule(
            _CLAIM_WAIT_S,
            retry_unavailable=False,  # an unreachable metaserver: the decode claims, the request goes on
            poll_cap_s=5.0,
            release_lease_s=_RELEASE_LEASE_S,
            release_poll_s=_RELEASE_POLL_S,
        )
        try:
            h = await claim_handoff(
                self._meta(), req.tid, d.id, rule=rule, holder=prev if prev != d.id else None, clock=perf_counter
            )
        except ClaimRefused as exc:
            if exc.code is Code.HANDOFF_TERMINAL:
                req.abort_reason = "kv_expired"
                raise KVExpired(
                    f"the KV of transfer {req.tid} is gone before decode {d.public} could claim it"
                ) from exc
            if exc.code is Code.KV_NOT_READY and req.prefill is not None and await self._still_pending(req.tid):
                req.abort_reason = "kv_not_ready"  # the prefill named it, yet its READY went elsewhere
                raise KVNotReady.never_ready(req.prefill.where("prefill"), req.tid, _CLAIM_WAIT_S, exc.message) from exc
            log.warning("handoff %s: claim for %s refused (%s); the decode claims", req.tid, d.id, exc)
            return None
        if h.deadline is None:
            return None
        claim = RouterClaim(d.id, h.deadline, max(h.deadline - h.updated_at, 0.0))
        return self._sealed_claim(req, claim, h)

    async def _still_pending(self, tid: str) -> bool:
        """Whether `tid` is still PENDING once the claim wait is over (`errors.KVNotReady.never_ready`)."""
        try:
            return (await self._meta().get_handoff(tid)).state is HandoffState.PENDING
        except MetaError:
            return False  # cannot tell: the decode claims by itself, as before

    def _sealed_claim(self, req: ProxiedRequest, claim: RouterClaim, h: Handoff) -> RouterClaim:
        """`claim` sealed over the location the ledger's record holds, which from now on is the
        `remote_location` every decode attempt gets (when the prefill's answer carried one: without it
        the decode waits for its claim's record anyway). Never the prefill's own copy: a prefill could
        name any address there, and a sealed location is one the decode pulls from without asking."""
        hint = req.prefill_kv.remote_location if req.prefill_kv is not None else None
        if hint is None:
            return claim.sealed(self._claim_key, transfer_id=req.tid, location=None)
        location = None if h.location is None else h.location.model_dump(mode="json", exclude_none=True)
        if not same_location(hint, h.location):
            log.warning("handoff %s: the prefill's remote_location is not the ledger's; the ledger's is sent", req.tid)
        if location is None:
            req.decode_kv.pop("remote_location", None)
        else:
            req.decode_kv["remote_location"] = location
        return claim.sealed(self._claim_key, transfer_id=req.tid, location=location)

    async def _decode_once(self, req: ProxiedRequest, d: LiveInstance, send: Send) -> str:
        where = Where(*d.where("decode"))
        facts = req.facts
        claim = await self._claim_for(req, d)
        n = req.body.get("n")
        siblings = n if type(n) is int and n > 1 else 1  # vLLM's decode fans it into n requests on one handoff
        # `decode_request` left no router keys in `decode_kv`, so the claim's fields are spliced onto its
        # encoding, as the params are onto the body's: neither is encoded again per attempt.
        fields = with_claim({}, claim, siblings=siblings)
        location = req.decode_kv.get("remote_location")  # the ledger's once claimed, else the prefill's hint
        if location is not None:
            fields["remote_location"] = location
        kv_json = with_fields(req.decode_kv_json, fields)
        assert req.spliced is not None
        payload = req.spliced.decode(orjson.Fragment(kv_json))
        req.last_decode = d.id
        error: RouterError | None = None
        with self._pool.lease(d, facts.prompt_tokens + facts.max_tokens, self._clock) as lease:
            try:
                ans = await open_answer(
                    self._upstream(),
                    d.view.url + req.endpoint,
                    self.headers(req, d),
                    payload,
                    stream=facts.stream,
                    timeout=self._d_timeout,
                    idle_timeout=self._idle_timeout,
                    where=where,
                    ttft=self._m.decode_ttft,
                    first_byte=self._first_byte,
                )
            except Exception:
                lease.failed()
                raise
            resp, v, data = ans.resp, ans.verdict, ans.data
            try:
                if v == Verdict.OK:
                    self._m.overhead.observe(req.overhead_s)
                    headers = [(b"content-type", resp.header(b"content-type") or _JSON), (b"x-request-id", req.rid)]
                    req.started = True
                    if not facts.stream:
                        lease.succeeded()
                        req.live = None  # the decode finished the handoff: nothing left to abort
                        await send_body(send, resp.status, headers, data or b"", req.end)
                        return "ok"
                    resumable = req.track is not None and self.resume is not None
                    error = await relay_stream(
                        send, resp, data, headers, self._idle_timeout, req.end, where, resumable=resumable
                    )
                    if error is None:
                        lease.succeeded()
                        req.live = None
                        return "ok"
                    lease.failed()
                    req.abort_reason = "decode_stream_broke"
                    if not resumable:
                        self._m.error(error.code.value)
                        log.warning("%s after the stream started: %s", error.code.value, detail(error))
                        return error.code.value
                else:
                    data = data or b""
                    if resp.status == 410:
                        lease.succeeded()
                        req.abort_reason = "kv_expired"
                        raise KVExpired(f"the KV of transfer {req.tid} expired before {where.public} could claim it")
                    if resp.status == 409:
                        # The decode could not claim the handoff: another decode holds it (an earlier attempt
                        # whose claim the router could not take back, the ledger down at that moment). The
                        # ledger's state, never the client's request: another attempt, or a resume, serves it.
                        lease.succeeded()
                        raise failed(DecodeFailed, where, "answered 409 (the handoff is claimed)", snippet(data))
                    if v == Verdict.REJECTED:
                        lease.succeeded()
                        req.abort_reason = "decode_rejected"
                        raise UpstreamRejected(resp.status, data, resp.header(b"content-type"))
                    lease.failed()
                    raise failed(DecodeFailed, where, f"answered {resp.status}", snippet(data))
            finally:
                resp.close()
        assert self.resume is not None
        return await self.resume(req, error, [*req.tried, d.id])

    # -- aborts ---------------------------------------------------------------------------------

    def abort(self, req: ProxiedRequest, reason: str) -> None:
        """Abort the request's live handoff in the background: the client's answer never waits for it."""
        tid = req.live
        if tid is None:
            return
        req.live = None
        self._m.aborts.labels(reason).inc()
        task = asyncio.get_running_loop().create_task(self._abort_now(tid, reason))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _abort_now(self, tid: str, reason: str) -> None:
        try:
            await self._meta().abort(tid, reason)
        except (MetaConflict, MetaGone, MetaNotFound):
            pass  # already DONE, ABORTED or EXPIRED: nothing left to free
        except MetaError as exc:
            log.warning("could not abort handoff %s (%s): %s", tid, reason, exc)

    async def drain_background(self, timeout: float = 5.0) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)

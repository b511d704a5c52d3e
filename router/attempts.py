"""The prefill and decode attempts of one proxied request, each retried on another instance.

A prefill attempt owns a fresh handoff (created here, aborted on failure); decode attempts reuse the
prefill's handoff. Only failures before the decode's first body byte are retried (see `pdgate.router.proxy`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from random import Random
from time import perf_counter
from typing import Any

from pdgate.metaserver.client import MetaAPI, MetaConflict, MetaError
from pdgate.metaserver.models import HandoffCreate
from pdgate.router.bodies import kv_params_from_prefill, prefill_body, prefill_params
from pdgate.router.errors import (
    DecodeFailed,
    KVExpired,
    MetaserverUnavailable,
    NoCompatiblePair,
    PrefillFailed,
    RouterError,
    UpstreamRejected,
    UpstreamTimeout,
)
from pdgate.router.logs import transfer_id as log_transfer_id
from pdgate.router.loops import HOP_HEADER, HOP_VALUE
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Policy
from pdgate.router.pool import Pool, Tracker
from pdgate.router.request_flow import _MAX_ANSWER, _Flow, _Retry, _snippet, mint_transfer_id
from pdgate.router.retry import Verdict, backoff, verdict
from pdgate.router.upstream import ReadTimeout, Upstream, UpstreamError, UpstreamResponse

from pdgate.errors import Code

log = logging.getLogger("pdgate.router.proxy")

_CREATE_TRIES = 3  # creates of one handoff before a taken transfer id is reported as a failure


class Attempts:
    """Prefill and decode attempts of `Proxy` (a mixin: the state lives on the proxy)."""

    _pool: Pool
    _meta: Callable[[], MetaAPI]
    _upstream: Callable[[], Upstream]
    _m: RouterMetrics
    _p_policy: Policy
    _d_policy: Policy
    _engine_meta: str | None
    _rng: Random
    _clock: Callable[[], float]
    _keys: list[bytes]
    _upstream_auth: bytes | None
    _p_attempts: int
    _d_attempts: int
    _backoff: tuple[float, float]
    _p_timeout: float
    _d_timeout: float
    _lease: float
    _retry_children: dict[str, Any]
    _abort: Callable[[_Flow, str], None]

    def _headers(self, flow: _Flow, tr: Tracker) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", b"application/json"), (b"x-request-id", flow.rid)]
        v = tr.view
        if v.dp_size > 1:
            h.append((b"x-data-parallel-rank", str(v.dp_rank).encode()))
        if self._upstream_auth is not None:
            h.append((b"authorization", self._upstream_auth))
        elif flow.client_auth is not None:  # set only with --forward-client-auth
            h.append((b"authorization", flow.client_auth))
        h.append((HOP_HEADER, HOP_VALUE))
        if flow.extra:
            h.extend(flow.extra)
        return h

    async def _sleep_before_retry(self, attempt: int) -> None:
        base, cap = self._backoff
        if base > 0:
            await asyncio.sleep(backoff(attempt, base, cap, self._rng))

    # -- prefill --------------------------------------------------------------------------------

    async def _prefill_phase(self, flow: _Flow, endpoint: str, body: dict[str, Any], facts: Any, model: str) -> dict:
        tried: list[str] = []
        last: RouterError | None = None
        for attempt in range(self._p_attempts):
            now = self._clock()
            cands = self._pool.prefill_candidates(model, now, tried)
            if not cands:
                if last is not None:
                    raise last
                raise NoCompatiblePair(self._pool.explain(model, now))
            p = cands[self._p_policy.choose(cands, facts, self._rng) or 0]
            tried.append(p.id)
            if attempt:
                self._retry_children["prefill"].inc()
                flow.tid = mint_transfer_id()
                log_transfer_id.set(flow.tid)
            await self._create_handoff(flow, p)
            try:
                kv = await self._prefill_once(flow, p, endpoint, body, facts)
            except _Retry as r:
                last = r.error
                self._abort(flow, "prefill_failed")
                log.warning("prefill %s failed (attempt %d/%d): %s", p.id, attempt + 1, self._p_attempts, last.message)
                if attempt + 1 < self._p_attempts:
                    await self._sleep_before_retry(attempt)
                continue
            except UpstreamRejected:
                flow.abort_reason = "prefill_rejected"
                raise
            flow.prefill = p
            return kv
        assert last is not None
        raise last

    async def _create_handoff(self, flow: _Flow, p: Tracker) -> None:
        t = perf_counter()
        for fresh in range(_CREATE_TRIES):
            if fresh:  # someone holds this id (squatted or, at 2**-128, a collision): draw another
                flow.tid = mint_transfer_id()
                log_transfer_id.set(flow.tid)
            try:
                h = await self._meta().create_handoff(
                    HandoffCreate(
                        prefill_instance_id=p.id,
                        transfer_id=flow.tid,
                        lease_s=self._lease,
                        request_id=flow.rid[:512].decode("latin-1"),
                    )
                )
                break
            except MetaConflict as exc:
                if exc.code != Code.HANDOFF_EXISTS.value or fresh + 1 == _CREATE_TRIES:
                    raise MetaserverUnavailable(f"cannot record the handoff: {exc.detail}") from exc
                log.warning("transfer id %s already exists in the ledger; retrying with a fresh id", flow.tid)
            except MetaError as exc:
                raise MetaserverUnavailable(f"cannot record the handoff: {exc.detail}") from exc
        flow.kv_key = h.kv_key
        flow.live = flow.tid
        self._m.handoff.observe(perf_counter() - t)

    async def _prefill_once(self, flow: _Flow, p: Tracker, endpoint: str, body: dict[str, Any], facts: Any) -> dict:
        payload = prefill_body(body, prefill_params(flow.tid, flow.kv_key, self._engine_meta))
        tokens = facts.prompt_tokens
        self._pool.begin(p, tokens, self._clock())
        ok: bool | None = None
        resp: UpstreamResponse | None = None
        t = perf_counter()
        try:
            resp = await self._upstream().request(
                "POST", p.view.url + endpoint, self._headers(flow, p), payload, timeout=self._p_timeout
            )
            data = await resp.read(timeout=self._p_timeout, limit=_MAX_ANSWER)
            v = verdict(resp.status)
            if v == Verdict.OK:
                try:
                    kv = kv_params_from_prefill(data)
                except PrefillFailed as exc:
                    ok = False
                    raise _Retry(PrefillFailed(f"prefill {p.id}: {exc.message}")) from exc
                ok = True
                return kv
            if v == Verdict.REJECTED:
                ok = True  # the request's fault, not the instance's
                raise UpstreamRejected(resp.status, data, resp.header(b"content-type"))
            ok = False
            raise _Retry(PrefillFailed(f"prefill {p.id} answered {resp.status}: {_snippet(data)}"))
        except ReadTimeout as exc:
            ok = False
            raise _Retry(UpstreamTimeout(f"prefill {p.id} sent nothing for {self._p_timeout:g} s")) from exc
        except UpstreamError as exc:
            ok = False
            raise _Retry(PrefillFailed(f"prefill {p.id} failed: {exc}")) from exc
        finally:
            if resp is not None:
                resp.close()
            self._pool.end(p, tokens)
            if ok is not None:
                self._pool.record(p, ok, self._clock())
            self._m.prefill.observe(perf_counter() - t)

    # -- decode ---------------------------------------------------------------------------------

    async def _decode_phase(
        self, flow: _Flow, endpoint: str, payload: bytes, facts: Any
    ) -> tuple[Tracker, UpstreamResponse, bytes | None]:
        assert flow.prefill is not None
        tried: list[str] = []
        last: RouterError | None = None
        for attempt in range(self._d_attempts):
            now = self._clock()
            cands = self._pool.decode_candidates(flow.prefill, now, tried)
            if not cands:
                flow.abort_reason = "decode_failed"
                if last is not None:
                    raise last
                raise NoCompatiblePair(
                    f"no available decode can take the KV of {flow.prefill.id}: "
                    + self._pool.explain(flow.prefill.view.model or "?", now)
                )
            d = cands[self._d_policy.choose(cands, facts, self._rng) or 0]
            tried.append(d.id)
            if attempt:
                self._retry_children["decode"].inc()
            try:
                return await self._decode_once(flow, d, endpoint, payload, facts)
            except _Retry as r:
                last = r.error
                log.warning("decode %s failed (attempt %d/%d): %s", d.id, attempt + 1, self._d_attempts, last.message)
                if attempt + 1 < self._d_attempts:
                    await self._sleep_before_retry(attempt)
        flow.abort_reason = "decode_failed"
        assert last is not None
        raise last

    async def _decode_once(
        self, flow: _Flow, d: Tracker, endpoint: str, payload: bytes, facts: Any
    ) -> tuple[Tracker, UpstreamResponse, bytes | None]:
        tokens = facts.prompt_tokens + facts.max_tokens
        self._pool.begin(d, tokens, self._clock())
        ok: bool | None = None
        keep = False
        resp: UpstreamResponse | None = None
        t = perf_counter()
        try:
            resp = await self._upstream().request(
                "POST", d.view.url + endpoint, self._headers(flow, d), payload, timeout=self._d_timeout
            )
            v = verdict(resp.status)
            if v == Verdict.OK:
                first = await resp.next_chunk(self._d_timeout) if facts.stream else None
                self._m.decode_ttft.observe(perf_counter() - t)
                keep = True
                return d, resp, first
            data = await resp.read(timeout=self._d_timeout, limit=_MAX_ANSWER)
            if resp.status == 410:
                ok = True
                flow.abort_reason = "kv_expired"
                raise KVExpired(f"the KV of transfer {flow.tid} expired before decode {d.id} could claim it")
            if v == Verdict.REJECTED:
                ok = True
                flow.abort_reason = "decode_rejected"
                raise UpstreamRejected(resp.status, data, resp.header(b"content-type"))
            ok = False
            raise _Retry(DecodeFailed(f"decode {d.id} answered {resp.status}: {_snippet(data)}"))
        except ReadTimeout as exc:
            ok = False
            raise _Retry(UpstreamTimeout(f"decode {d.id} sent nothing for {self._d_timeout:g} s")) from exc
        except UpstreamError as exc:
            ok = False
            raise _Retry(DecodeFailed(f"decode {d.id} failed before its first byte: {exc}")) from exc
        finally:
            if not keep:
                if resp is not None:
                    resp.close()
                self._pool.end(d, tokens)
                if ok is not None:
                    self._pool.record(d, ok, self._clock())

"""pdgate-sim's ledger side: registry records per DP rank, heartbeats, and the PD handoff steps.

A prefill records READY and answers the `kv_transfer_params` of the blocks it holds; a decode claims,
checks that its params come from the prefill that holds the handoff, then marks DONE. A decode whose
params carry the router's claim for it (`KVTransferParams.trusted_until`) makes no claim of its own, as
the connector does: it marks DONE and checks the record DONE answers with. A mismatch is
counted and aborted. The params are built and read with `pdgate.contract.KVTransferParams`,
the same contract the router and the connector use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pdgate.sim.holds import Holds
from pdgate.sim.settings import Script, SimSettings, Stats
from pdgate.sim.wire import Reject

from pdgate import claim_seal
from pdgate.claim_wait import ClaimRefused, ClaimRule, claim_handoff
from pdgate.contract import KVTransferParams
from pdgate.errors import Code
from pdgate.http_pool import HttpPool
from pdgate.meta_client import MetaClient, MetaError, MetaGone, MetaNotFound
from pdgate.meta_pooled import PooledMetaClient
from pdgate.models import Handoff, InstanceLoad, InstanceRegistration, KVLocation, Role

__all__ = ["Ledger"]

log = logging.getLogger("pdgate.sim")

# A claim refused for one of these found nothing left to claim: the KV expired or was aborted.
_GONE = frozenset({Code.HANDOFF_TERMINAL, Code.HANDOFF_NOT_FOUND, Code.NOT_FOUND})


class Ledger:
    """The simulator's metaserver calls: one client per metaserver URL over one HTTP pool."""

    def __init__(
        self, settings: SimSettings, url: str, base_id: str, role: Role, script: Script, stats: Stats, holds: Holds
    ) -> None:
        self.s = settings
        self.url = url
        self.base_id = base_id
        self.role = role
        self.script = script
        self.stats = stats
        self.holds = holds
        self.http: HttpPool | None = None
        self.registered: set[int] = set()
        self._clients: dict[str, MetaClient] = {}
        self._next_block = 0
        self.claim_key = claim_seal.claim_key(self.s.admin_token)  # as the connector: no token, no trust

    def record_id(self, rank: int) -> str:
        return self.base_id if self.s.dp_size == 1 else f"{self.base_id}.dp{rank}"

    def meta(self, url: str) -> MetaClient:
        client = self._clients.get(url)
        if client is None:
            if self.http is None:
                self.http = HttpPool()
            client = PooledMetaClient(
                url,
                pool=self.http,
                admin_token=self.s.admin_token,
                timeout=self.s.metaserver_timeout_s,
                batches=2,  # READY, claim, DONE of requests in flight ride together, as the connector's do
            )
            self._clients[url] = client
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        if self.http is not None:
            await self.http.aclose()

    # -- registry ---------------------------------------------------------------------------

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

    async def register_all(self) -> None:
        """Register every rank not registered yet; a metaserver that is not up yet is retried later."""
        assert self.s.metaserver
        meta = self.meta(self.s.metaserver)
        for rank in range(self.s.dp_size):
            if rank in self.registered:
                continue
            try:
                await meta.register(self.registration(rank))
                self.registered.add(rank)
            except MetaError as exc:
                log.warning("registering %s failed (will retry): %s", self.record_id(rank), exc.detail)

    async def heartbeat_loop(self) -> None:
        assert self.s.metaserver
        meta = self.meta(self.s.metaserver)
        while True:
            pending = len(self.registered) < self.s.dp_size
            await asyncio.sleep(0.2 if pending else self.s.lease_s / 3)
            await self.register_all()
            for rank in sorted(self.registered):
                load = InstanceLoad(running=self.stats.inflight[rank])
                try:
                    await meta.heartbeat(self.record_id(rank), load)
                except MetaNotFound:  # our lease lapsed (e.g. the metaserver restarted): register again
                    self.registered.discard(rank)
                except MetaError as exc:
                    log.warning("heartbeat of %s failed: %s", self.record_id(rank), exc.detail)

    async def deregister_all(self) -> None:
        assert self.s.metaserver
        meta = self.meta(self.s.metaserver)
        for rank in sorted(self.registered):
            with contextlib.suppress(MetaError):
                await meta.deregister(self.record_id(rank))

    # -- the PD steps -----------------------------------------------------------------------

    async def prefill(
        self, kv: KVTransferParams, rank: int, prompt_tokens: int, meta_url: str | None, rid: str
    ) -> dict[str, Any] | None:
        """Hold blocks for the prompt, record READY, and return the params a decode needs (None when
        the script says the prefill forgets them)."""
        tid = kv.transfer_id
        n_blocks = max(1, -(-prompt_tokens // self.s.block_size))
        blocks = tuple(range(self._next_block, self._next_block + n_blocks))
        self._next_block += n_blocks
        engine_id = self.record_id(rank)
        remote_rid = f"cmpl-{rid or tid or 'sim'}-0-{self._next_block:08x}"
        if meta_url and tid:
            location = KVLocation(
                block_ids=[list(blocks)],
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
                ready = await self.meta(meta_url).mark_ready(tid, location)
                self.holds.hold(tid, n_blocks, meta_url, ready.lease_s)
            except MetaError as exc:
                self.stats.inc("ledger_errors")
                raise Reject(500, f"could not record READY for {tid}: {exc.detail}", "ledger_error") from exc
        else:
            self.stats.inc("prefill_without_ledger")
        if self.script.no_kv_params:
            return None
        answer = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=engine_id,
            remote_block_ids=(blocks,),
            remote_request_id=remote_rid,
            remote_num_tokens=prompt_tokens,
            transfer_id=tid,
            kv_key=kv.kv_key,
            extra={
                "remote_host": self.s.host,
                "remote_port": self.s.port,
                "remote_dp_rank": rank,
                "tp_size": self.s.tp_size,
            },
        )
        return answer.to_dict()

    async def claim(self, kv: KVTransferParams, rank: int, meta_url: str | None) -> None:
        """Claim the handoff as the connector does (`pdgate.claim_wait`: waiting while it is PENDING, failing
        when another decode holds it), check that the params come from the prefill that holds it, and
        mark it DONE."""
        engine = kv.remote_engine_id
        tid = kv.transfer_id
        if not engine:
            raise Reject(400, "decode request without remote_engine_id in kv_transfer_params")
        if not (meta_url and tid):
            self.stats.inc("decode_without_ledger")
            return
        meta = self.meta(meta_url)
        me = self.record_id(rank)
        if kv.trusted_until(me, self.claim_key) is not None:  # sealed by the router for this decode
            self.stats.inc("router_claims")
            try:
                h = await meta.done(tid, me)
            except (MetaGone, MetaNotFound) as exc:
                self.stats.inc("kv_expired")
                raise Reject(410, f"handoff {tid} is gone: {exc.detail}", "kv_expired") from exc
            except MetaError as exc:
                self.stats.inc("ledger_errors")
                raise Reject(500, f"could not record DONE for {tid}: {exc.detail}", "ledger_error") from exc
            bad = self._mismatch(h, engine, tid)
            if bad is not None:
                raise bad
            self.stats.inc("claimed")
            return
        rule = ClaimRule(self.s.claim_wait_s)
        try:
            h = await claim_handoff(meta, tid, me, rule=rule, lease_s=self.s.claim_lease_s)
        except ClaimRefused as exc:
            raise self._refused(tid, exc) from exc
        bad = self._mismatch(h, engine, tid)
        if bad is not None:
            with contextlib.suppress(MetaError):
                await meta.abort(tid, "kv_transfer_params do not match the handoff")
            raise bad
        try:
            await meta.done(tid, me)
        except MetaError as exc:
            self.stats.inc("ledger_errors")
            raise Reject(500, f"could not record DONE for {tid}: {exc.detail}", "ledger_error") from exc
        self.stats.inc("claimed")

    def _refused(self, tid: str, exc: ClaimRefused) -> Reject:
        """The answer to a claim `pdgate.claim_wait` refused (counted): gone -> 410, not claimable in
        time -> 504, claimed by another decode -> 409, the metaserver unreachable or refusing -> 503."""
        if exc.code in _GONE:
            self.stats.inc("kv_expired")
            return Reject(410, f"handoff {tid} is gone: {exc.message}", "kv_expired")
        if exc.code is Code.KV_NOT_READY:
            return Reject(504, f"handoff {tid}: {exc.message}", exc.code.value)
        if exc.code is Code.ILLEGAL_TRANSITION:
            self.stats.inc("claimed_elsewhere")
            return Reject(409, f"handoff {tid}: {exc.message}", exc.code.value)
        self.stats.inc("ledger_errors")
        return Reject(503, f"ledger unavailable: {exc.message}", "ledger_error")

    def _mismatch(self, h: Handoff, engine: str, tid: str) -> Reject | None:
        """None when the params name the engine that holds the handoff's KV; else the refusal (counted)."""
        loc = h.location
        if loc is not None and loc.engine_id == h.prefill_instance_id and engine == loc.engine_id:
            return None
        self.stats.inc("mismatches")
        return Reject(
            500,
            f"kv_transfer_params name engine {engine!r} but handoff {tid} is held by prefill "
            f"{h.prefill_instance_id!r} with KV on {loc.engine_id if loc else None!r}",
            "kv_mismatch",
        )

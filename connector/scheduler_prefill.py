"""The scheduler half's prefill side: hold a finished prompt's blocks until the ledger lets them go.

A request with `do_remote_decode` in its `kv_transfer_params`:
  request_finished -> hold the blocks, command MarkReady, return the params the router forwards to D.
  A terminal state for the transfer (event feed, a failed MarkReady, a Check) -> the workers report the
  request as finished sending (vLLM frees the blocks). If the metaserver has been unreachable for longer
  than the lease + margin, the blocks are freed on that local deadline instead (counted).

P frees on the ledger's word, not on a timer, because only the ledger knows whether a decode is still
reading: freeing early would let the decode read reused blocks. The local deadline exists so that a
metaserver outage cannot pin a prefill's memory forever.

Pure bookkeeping like the rest of the scheduler half: `now` is an argument, I/O leaves as commands.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.connector.blocks import prompt_digest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.counters import COUNTERS
from pdgate.connector.location import EngineFacts, location_for
from pdgate.connector.logs import about
from pdgate.connector.messages import Check, CheckResult, FeedStatus, MarkReady, ReadyFailed, ReadyRecorded, Terminal
from pdgate.connector.outbox import Outbox

from pdgate.contract import InvalidTransferParams, KVTransferParams
from pdgate.models import TERMINAL_STATES, TransportAddress

__all__ = ["PrefillSide"]

logger = logging.getLogger(__name__)

# How a prefill must have ended for its KV to be worth keeping for a decode.
_KEEP_STATUSES = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


@dataclass
class _Hold:
    req_id: str
    transfer_id: str
    finished_at: float
    lease_s: float
    next_check_at: float
    announced: bool = False  # vLLM has listed the id in finished_req_ids (workers may report it)
    free_reason: str | None = None


class PrefillSide:
    """See the module docstring. One per scheduler half; engine-core thread only."""

    def __init__(self, cfg: ConnectorConfig, facts: EngineFacts, out: Outbox) -> None:
        self._cfg = cfg
        self._facts = facts
        self._out = out
        self._holds: dict[str, _Hold] = {}  # transfer_id -> hold
        self._hold_by_req: dict[str, str] = {}  # req_id -> transfer_id
        self._new_holds: list[str] = []
        self._last_feed_ok: float | None = None
        self.addresses: list[TransportAddress] = []  # the workers', advertised in every location

    # ---- vLLM hook ----------------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: Sequence[int], *, now: float
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if request.status.name not in _KEEP_STATUSES or not block_ids:
            # Aborted or failed before a finished prefill, or no KV at all: nothing to keep.
            self._out.bump("prefill_not_kept")
            return False, None
        try:
            asked = KVTransferParams.parse(request.kv_transfer_params)
            transfer_id = asked.require_transfer_id()
        except InvalidTransferParams as exc:
            self._out.bump("bad_params")
            self._out.bump("prefill_not_kept")
            logger.error("prefill %s: %s; its KV is not kept", req_id, exc)
            return False, None
        if transfer_id in self._holds:
            self._out.bump("prefill_not_kept")
            logger.error(
                "prefill %s: transfer %s is already held by %s",
                req_id,
                transfer_id,
                self._holds[transfer_id].req_id,
                extra=about(transfer_id),
            )
            return False, None
        f = self._facts
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        location, kept = location_for(
            f, block_ids=block_ids, num_tokens=num_tokens, addresses=self.addresses, remote_request_id=req_id
        )
        lease = self._cfg.kv_lease_s
        self._holds[transfer_id] = _Hold(req_id, transfer_id, now, lease, now + lease + self._cfg.free_margin_s)
        self._hold_by_req[req_id] = transfer_id
        self._new_holds.append(req_id)
        self._out.send(MarkReady(transfer_id, location))
        self._out.bump("sends_held")
        logger.debug(
            "transfer %s: prefill %s holds %d blocks (%d tokens)",
            transfer_id,
            req_id,
            len(kept),
            num_tokens,
            extra=about(transfer_id),
        )
        # What the router forwards to the decode. The decode trusts the ledger's location over these
        # fields; `remote_location` is the READY record itself, which lets it start pulling while its
        # claim is in flight (it uses the data only once the claimed record matches).
        answer = KVTransferParams(
            do_remote_prefill=True,
            transfer_id=transfer_id,
            kv_key=asked.kv_key,
            remote_block_ids=tuple(kept),
            remote_engine_id=f.engine_id,
            remote_num_tokens=num_tokens,
            remote_prompt_digest=prompt_digest(getattr(request, "prompt_token_ids", None), num_tokens),
            remote_request_id=req_id,
            prefill_instance_id=f.instance_id,
            remote_location=location.model_dump(mode="json", exclude_none=True),
        )
        return True, answer.to_dict()

    # ---- control-thread results ---------------------------------------------------------------------

    def on_feed(self, status: FeedStatus) -> None:
        if status.ok and (self._last_feed_ok is None or status.at > self._last_feed_ok):
            self._last_feed_ok = status.at

    def on_terminal(self, event: Terminal) -> None:
        self._free(event.transfer_id, event.state.lower())

    def on_ready_recorded(self, result: ReadyRecorded, now: float) -> None:
        hold = self._holds.get(result.transfer_id)
        self._out.bump("ready_recorded")
        if hold is not None:
            hold.lease_s = result.lease_s
            hold.next_check_at = now + result.lease_s + self._cfg.free_margin_s

    def on_ready_failed(self, result: ReadyFailed) -> None:
        self._out.bump("ready_failed")
        logger.warning(
            "transfer %s: READY not recorded (%s): %s",
            result.transfer_id,
            result.code.value,
            result.message,
            extra=about(result.transfer_id),
        )
        if result.terminal:
            self._free(result.transfer_id, "ready_failed")

    def on_check(self, result: CheckResult) -> None:
        if not result.found:
            self._free(result.transfer_id, "not_found")
        elif result.state is not None and result.state in TERMINAL_STATES:
            self._free(result.transfer_id, result.state.value.lower())

    # ---- per step -----------------------------------------------------------------------------------

    def take_step(self, finished_req_ids: Iterable[str], *, now: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(request ids newly held, held request ids to report as finished sending) for this step."""
        for req_id in finished_req_ids:
            transfer_id = self._hold_by_req.get(req_id)
            if transfer_id is not None:
                self._holds[transfer_id].announced = True
        self._check(now)
        frees = []
        for transfer_id, hold in list(self._holds.items()):
            if hold.free_reason is not None and hold.announced:
                frees.append(hold.req_id)
                del self._holds[transfer_id]
                del self._hold_by_req[hold.req_id]
        holds, self._new_holds = tuple(self._new_holds), []
        return holds, tuple(frees)

    def held_transfer_ids(self) -> list[str]:
        return list(self._holds)

    # ---- internals ----------------------------------------------------------------------------------

    def _free(self, transfer_id: str, reason: str) -> None:
        hold = self._holds.get(transfer_id)
        if hold is None or hold.free_reason is not None:
            return
        hold.free_reason = reason
        key = f"sends_freed_{reason}"
        self._out.bump(key if key in COUNTERS else "sends_freed_not_found")
        logger.debug("transfer %s: freeing prefill %s (%s)", transfer_id, hold.req_id, reason, extra=about(transfer_id))

    def _check(self, now: float) -> None:
        margin = self._cfg.free_margin_s
        for hold in self._holds.values():
            if hold.free_reason is not None or now < hold.next_check_at:
                continue
            limit = hold.lease_s + margin
            feed_stale = self._last_feed_ok is None or now - self._last_feed_ok > limit
            if feed_stale and now - hold.finished_at > limit:
                logger.warning(
                    "transfer %s: no word from the metaserver for over %.0fs; freeing prefill %s locally",
                    hold.transfer_id,
                    limit,
                    hold.req_id,
                    extra=about(hold.transfer_id),
                )
                self._free(hold.transfer_id, "local_deadline")
            else:
                # The feed is alive but said nothing about this transfer: ask (a lost event or record).
                self._out.send(Check(hold.transfer_id))
                hold.next_check_at = now + hold.lease_s

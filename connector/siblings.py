"""The decode side's sibling bookkeeping: requests that load one handoff together, and when it ends.

vLLM's decode fans a request with n > 1 into n child requests carrying the same `kv_transfer_params`.
They share the handoff (`Share`): one claim (the first sibling's, or the router's), each sibling pulls
the prefill's blocks into its own, and DONE (or the abort) goes out once the last one settled (pulled
or failed), so the prefill holds its blocks until every sibling read them. `siblings` in the params
says how many to wait for; without it, a sibling that arrives while the others still load joins them.
A sibling that reads nothing (its prefix was cached here, its prompt differs, it ended unscheduled) is
released through its share too (`release`): it settles as one that read nothing, so it never ends the
handoff under a sibling that still reads it. A request without siblings is a share of one.

Pure bookkeeping for `scheduler_decode.DecodeSide`; the per-request state lives in `decode_recv.py`, this
module holds only what the siblings share and the rule for the end. Engine-core thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdgate.connector.messages import Abort, ClaimFailed, Done
from pdgate.connector.outbox import Outbox

from pdgate.models import Handoff

__all__ = ["Share", "Siblings"]


@dataclass
class Share:
    """What the sibling requests of one handoff share: the claim and the end."""

    expected: int  # siblings announced (`siblings` in the params, else 1)
    joined: int = 0
    loading: int = 0  # siblings that load (the first of them claims, unless the router did)
    settled: int = 0
    ok: int = 0
    abort: str | None = None  # why to abort at the end, when no sibling pulled
    gone: bool = False  # a sibling failed on a record already terminal or unknown: nothing to abort
    handoff: Handoff | None = None  # the claimed record, for a sibling joining after the claim answered
    claim_failed: ClaimFailed | None = None


class Siblings:
    """The shares of the handoffs being loaded, by transfer id, until their DONE or abort went out."""

    def __init__(self, out: Outbox) -> None:
        self._out = out
        self._shares: dict[str, Share] = {}

    def get(self, transfer_id: str) -> Share | None:
        return self._shares.get(transfer_id)

    def join(self, transfer_id: str, expected: int) -> tuple[Share, bool]:
        """One more sibling loads `transfer_id`; (its share, whether it is the first to load)."""
        share = self._shares.get(transfer_id)
        if share is None:
            share = self._shares[transfer_id] = Share(expected=expected)
        share.joined += 1
        share.loading += 1
        return share, share.loading == 1

    def settle(self, transfer_id: str, *, ok: bool, abort: str | None = None) -> bool:
        """One sibling pulled (`ok`) or failed (`abort`: why to abort if none pulled; None: the record is
        gone, nothing to abort); False when the handoff has no share any more (its DONE or abort went
        out already)."""
        share = self._shares.get(transfer_id)
        if share is None:
            return False
        share.settled += 1
        if ok:
            share.ok += 1
        elif abort is None:
            share.gone = True
        elif share.abort is None:
            share.abort = abort
        self._end_if_last(transfer_id, share)
        return True

    def release(self, transfer_id: str, expected: int, reason: str) -> None:
        """A sibling that reads nothing settles as one that read nothing; once the last sibling settled,
        DONE (another one pulled) or the abort (`reason` unless an earlier one is known) goes out. Alone
        (`expected` 1, no sibling loading), that is at once."""
        share = self._shares.get(transfer_id)
        if share is None:
            share = self._shares[transfer_id] = Share(expected=expected)
        share.joined += 1
        share.settled += 1
        if share.abort is None:
            share.abort = reason
        self._end_if_last(transfer_id, share)

    def _end_if_last(self, transfer_id: str, share: Share) -> None:
        """Once every sibling settled: DONE if any pulled (the prefill may free), else the abort."""
        if share.settled < max(share.expected, share.joined):
            return
        del self._shares[transfer_id]
        if share.ok:
            self._out.send(Done(transfer_id))
        elif share.abort is not None and not share.gone:
            self._out.send(Abort(transfer_id, share.abort))

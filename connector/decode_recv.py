"""The decode loads in progress: one request's pull (`Recv`, its states) and the table of them (`Loads`),
which also keeps how a load ends: the report for the workers (`RecvDone`), its share's settlement
(`siblings.py`), the counters and the one log line per load.

`scheduler_decode.py` holds the rules (when a load may be reported, when it must wait or fail); this module
holds the records they move and the bookkeeping every end shares, so each end is written once.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from pdgate.connector.logs import about
from pdgate.connector.messages import Abort
from pdgate.connector.metadata import PullOutcome, RecvDone, RecvPlan
from pdgate.connector.outbox import Outbox
from pdgate.connector.siblings import Siblings

from pdgate.errors import Code

__all__ = ["Loads", "Recv", "RecvState", "reported"]

logger = logging.getLogger(__name__)

_CLAIM_SAMPLES = 4096  # the latest claim latencies kept for the stats snapshot


class RecvState(enum.Enum):
    CLAIMING = "claiming"  # no pull yet: waiting for the claim (and the ledger's location)
    PULLING = "pulling"  # the workers are pulling (claimed or not yet)
    PULLED = "pulled"  # every worker pulled; waiting for the claim
    CONFIRMING = "confirming"  # claimed and pulled, but past the claim lease: waiting for DONE


@dataclass
class Recv:
    req_id: str
    transfer_id: str
    local_block_ids: tuple[int, ...]
    hit_blocks: int
    num_tokens: int
    deadline: float
    state: RecvState = RecvState.CLAIMING
    outcomes: dict[int, PullOutcome] = field(default_factory=dict)
    early: RecvPlan | None = None  # the plan started from the params' location, before the claim
    claimed: bool = False
    claim_lease_s: float = 0.0
    by_router: bool = False  # claimed by the router for us: the workers report the pull themselves
    sync: bool = False  # loaded synchronously, in the step that computes its first token (`decode_load.py`)
    settled: bool = False  # counted in its `siblings.Share` (pulled, or failed)
    # Monotonic stamps of each phase, for the one log line per transfer. `started_at` is also when the
    # claim was sent (the ledger's claim time is later), the base of the claim-lease bound.
    started_at: float = 0.0
    claimed_at: float | None = None
    pull_started_at: float | None = None
    pulled_at: float | None = None


def reported(outcome: PullOutcome | None) -> bool:
    """Whether a worker reported this pull finished to vLLM itself (under the router's claim)."""
    return outcome is not None and outcome.reported


class Loads:
    """The loads in progress by request id and by handoff (siblings load one handoff together), and the
    end of each: the RecvDone reports gathered for the next step, the share settled, counted, logged."""

    def __init__(self, out: Outbox, siblings: Siblings, world_size: int) -> None:
        self._out = out
        self._siblings = siblings
        self._world_size = world_size
        self._by_req: dict[str, Recv] = {}
        self._by_transfer: dict[str, list[str]] = {}  # transfer_id -> req ids loading it
        self._done: list[RecvDone] = []
        # Claim latency (ms) of the latest loads, from allocation to the claim in hand (0 for the router's).
        self._claim_ms: deque[float] = deque(maxlen=_CLAIM_SAMPLES)

    # ---- the table ----------------------------------------------------------------------------------

    def add(self, rec: Recv) -> None:
        self._by_req[rec.req_id] = rec
        self._by_transfer.setdefault(rec.transfer_id, []).append(rec.req_id)

    def get(self, req_id: str) -> Recv | None:
        return self._by_req.get(req_id)

    def members(self, transfer_id: str) -> list[Recv]:
        """The requests loading `transfer_id` (siblings, or the one request)."""
        return [self._by_req[r] for r in self._by_transfer.get(transfer_id, ()) if r in self._by_req]

    def all(self) -> list[Recv]:
        return list(self._by_req.values())

    def __len__(self) -> int:
        return len(self._by_req)

    def take_done(self) -> list[RecvDone]:
        """The loads ended since the last step, for the workers to report to vLLM."""
        done, self._done = self._done, []
        return done

    def claim_latency_ms(self) -> list[float]:
        """The claim latency of the latest loads (ms, oldest first), for the stats snapshot."""
        return list(self._claim_ms)

    # ---- how a load ends ----------------------------------------------------------------------------

    def settle(self, rec: Recv, *, ok: bool, abort: str | None = None) -> None:
        """`rec` pulled (`ok`) or failed; once every sibling did, DONE (any pulled) or the abort goes out."""
        if not rec.settled and self._siblings.settle(rec.transfer_id, ok=ok, abort=abort):
            rec.settled = True
            return
        if abort is not None and not ok:  # its DONE went out and failed: give the handoff up
            self._out.send(Abort(rec.transfer_id, abort))

    def unreported(self, rec: Recv) -> frozenset[int] | None:
        """The TP ranks that still need a RecvDone (None: all): under the router's claim a worker may have
        reported the request itself."""
        if not rec.by_router:
            return None
        return frozenset(r for r in range(self._world_size) if not reported(rec.outcomes.get(r)))

    def complete_ok(self, rec: Recv, now: float) -> None:
        """`rec` loaded: the workers report it (those that did not already), counted and logged."""
        self._log_loaded(rec, now)
        self._drop(rec)
        ranks = self.unreported(rec)
        if ranks is None or ranks:
            self._done.append(RecvDone(rec.req_id, True, ranks=ranks))
        self._out.bump("recv_ok")
        self._out.bump("tokens_loaded", rec.num_tokens)

    def fail(self, rec: Recv, code: Code, message: str, *, abort: bool) -> None:
        """`rec` failed: its blocks are reported as load errors; `abort`: the handoff is given up (once
        no sibling pulled it) rather than already terminal."""
        logger.warning(
            "transfer %s: KV load for %s failed (%s): %s",
            rec.transfer_id,
            rec.req_id,
            code.value,
            message,
            extra=about(rec.transfer_id),
        )
        self._drop(rec)
        ranks = self.unreported(rec)
        if ranks is None or ranks:
            self._done.append(RecvDone(rec.req_id, False, rec.local_block_ids, ranks=ranks, sync=rec.sync))
        self._count_failure(len(rec.local_block_ids))
        self.settle(rec, ok=False, abort=f"decode KV load failed: {code.value}: {message}"[:1000] if abort else None)

    def fail_unstarted(self, req_id: str, local: tuple[int, ...], *, sync: bool = False) -> None:
        """A load that fails before it has a record (unreadable params, too late to join its siblings)."""
        self._done.append(RecvDone(req_id, False, local, sync=sync))
        self._count_failure(len(local))

    def _log_loaded(self, rec: Recv, now: float) -> None:
        # claim: until the claim's answer; pull: from the plan to every worker's outcome (it overlaps the
        # claim when it started early); confirm: from the later of the two to the report.
        claimed = rec.claimed_at if rec.claimed_at is not None else now
        pulled = rec.pulled_at if rec.pulled_at is not None else now
        pull_from = rec.pull_started_at if rec.pull_started_at is not None else claimed
        pull_s = max((o.elapsed_s for o in rec.outcomes.values()), default=0.0)
        self._claim_ms.append((claimed - rec.started_at) * 1e3)
        if rec.sync:
            # Heard of after the forward it fed: the pull's share of the path is what the step waited.
            waited = max((o.waited_s for o in rec.outcomes.values()), default=0.0)
            total, pull, confirm = waited, waited, 0.0
        else:
            total, pull = now - rec.started_at, max(pulled - pull_from, 0.0)
            confirm = max(now - max(claimed, pulled), 0.0)
        logger.info(
            "transfer %s: %s loaded %d tokens in %.1f ms (claim %.1f, pull %.1f [transport %.1f], confirm %.1f)%s",
            rec.transfer_id,
            rec.req_id,
            rec.num_tokens,
            total * 1e3,
            (claimed - rec.started_at) * 1e3,
            pull * 1e3,
            pull_s * 1e3,
            confirm * 1e3,
            (" under the router's claim" if rec.by_router else "") + (", synchronously" if rec.sync else ""),
            extra=about(rec.transfer_id),
        )

    def _drop(self, rec: Recv) -> None:
        self._by_req.pop(rec.req_id, None)
        members = self._by_transfer.get(rec.transfer_id)
        if members is not None:
            if rec.req_id in members:
                members.remove(rec.req_id)
            if not members:
                del self._by_transfer[rec.transfer_id]

    def _count_failure(self, nblocks: int) -> None:
        self._out.bump("recv_failed")
        self._out.bump("invalid_blocks", nblocks)

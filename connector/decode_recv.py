"""One decode request's pull in progress, as the scheduler half's decode side tracks it
(`scheduler_decode.py` holds the rules; this is the record they move and its states)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdgate.connector.metadata import PullOutcome, RecvPlan

__all__ = ["Recv", "RecvState", "reported"]


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

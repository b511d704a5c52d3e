"""Messages between the scheduler half (engine-core thread) and its control thread (metaserver I/O).

The scheduler half never waits on I/O inside a vLLM hook: it appends a command here, the facade hands it
to the control thread, and the answer comes back as a result that the next hook drains. Both directions
are frozen dataclasses; `at` stamps are `time.monotonic()` of the control thread (same process, same
clock as the scheduler half's `now`). A failed result carries a `pdgate.errors.Code`, which is what the
scheduler half branches on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdgate.errors import Code
from pdgate.models import Handoff, HandoffState, InstanceRegistration, KVLocation

__all__ = [
    "Abort",
    "Check",
    "CheckResult",
    "Claim",
    "ClaimFailed",
    "Claimed",
    "Command",
    "Done",
    "DoneResult",
    "FeedStatus",
    "MarkReady",
    "ReadyFailed",
    "ReadyRecorded",
    "Register",
    "Registered",
    "Result",
    "Terminal",
]

# ---- commands (scheduler half -> control thread) ------------------------------------------------


@dataclass(frozen=True)
class MarkReady:
    """Prefill: record READY with where the KV lives (retried while the metaserver is unreachable)."""

    transfer_id: str
    location: KVLocation


@dataclass(frozen=True)
class Claim:
    """Decode: claim the handoff, waiting while it is still PENDING."""

    transfer_id: str


@dataclass(frozen=True)
class Done:
    """Decode: every worker pulled; record DONE (which also confirms the prefill still held the KV)."""

    transfer_id: str


@dataclass(frozen=True)
class Abort:
    """Give the handoff up (failed pull, or the decode no longer needs it) so the prefill frees at once."""

    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Check:
    """Prefill: ask for the state of a handoff held longer than its lease (lost event, lost record)."""

    transfer_id: str


@dataclass(frozen=True)
class Register:
    """Register the instance (retrying until it works), then heartbeat; prefills also start the feed."""

    registration: InstanceRegistration


Command = MarkReady | Claim | Done | Abort | Check | Register

# ---- results (control thread -> scheduler half) -------------------------------------------------


@dataclass(frozen=True)
class ReadyRecorded:
    transfer_id: str
    kv_key: int | None
    lease_s: float


@dataclass(frozen=True)
class ReadyFailed:
    """`terminal`: the ledger will never need these blocks (gone, unknown, refused): free them now."""

    transfer_id: str
    code: Code
    message: str
    terminal: bool


@dataclass(frozen=True)
class Claimed:
    transfer_id: str
    handoff: Handoff


@dataclass(frozen=True)
class ClaimFailed:
    transfer_id: str
    code: Code
    message: str


@dataclass(frozen=True)
class DoneResult:
    """`valid`: the prefill still held the KV while we read it (DONE recorded, or the record is still live)."""

    transfer_id: str
    valid: bool
    code: Code | None = None
    message: str | None = None


@dataclass(frozen=True)
class Terminal:
    """A terminal handoff state seen on the prefill's event feed (or by a `Check`)."""

    transfer_id: str
    state: str  # HandoffState value, or "NOT_FOUND"
    reason: str | None = None


@dataclass(frozen=True)
class CheckResult:
    """`state` None: the metaserver could not be asked; the hold stays until the local deadline."""

    transfer_id: str
    state: HandoffState | None
    found: bool = True


@dataclass(frozen=True)
class FeedStatus:
    """The prefill's event feed answered (`ok`) or failed at `at`."""

    ok: bool
    at: float


@dataclass(frozen=True)
class Registered:
    instance_id: str
    lease_s: float


Result = (
    ReadyRecorded | ReadyFailed | Claimed | ClaimFailed | DoneResult | Terminal | CheckResult | FeedStatus | Registered
)

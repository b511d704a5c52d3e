"""TEST DOUBLE: an in-process `Transport` that copies bytes between regions registered in ONE process.

It is a real implementation of `pdgate.connector.transport.base.Transport` (register, address, pull, poll,
close), used by the connector's worker-half tests to move real KV bytes between two tensors without NIXL
or a second process. Peers find each other through a process-wide registry keyed by name, the way a real
transport finds a peer through its address. Bytes move with `ctypes.memmove` on `poll()`, after
`complete_after_polls` polls, so tests can observe a pull while it is in flight. It honours
`PullRequest.ranges` (`sub_block`), the byte ranges of a pull re-cutting KV heads over unequal TP.

Knobs for failure tests (all explicit, nothing random):
* `fail_next(error)`: the next pull fails with that `TransportError` when it would have completed.
* a peer that was `close()`d is unreachable (`PeerUnreachable`), as a dead prefill would be.
* `timeout_s` / `pull_timeout_s`: a pull still pending after its deadline fails with `PullTimeout`
  (with `complete_after_polls` large, that is how a hung peer looks).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pdgate.connector.transport.base import (
    KVRegion,
    PullRequest,
    PullResult,
    Transport,
)
from pdgate.connector.transport.errors import (
    InvalidPull,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    TransportError,
)

__all__ = ["MemoryTransport"]

_names = itertools.count(1)


@dataclass
class _Pending:
    req: PullRequest
    peer: str
    polls_left: int
    started: float
    deadline: float


class MemoryTransport(Transport):
    kind = "memory"
    layerwise = True
    sub_block = True

    # name -> live transport; the "network" of this process.
    _world: ClassVar[dict[str, MemoryTransport]] = {}

    def __init__(
        self,
        name: str | None = None,
        *,
        complete_after_polls: int = 1,
        pull_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name or f"mem-{next(_names)}"
        if self.name in self._world:
            raise RegistrationError(f"a memory transport named {self.name!r} already exists")
        self._complete_after = complete_after_polls
        self._timeout_s = pull_timeout_s
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._ready: list[PullResult] = []
        self._served: list[str] = []
        self._fail_next: TransportError | None = None
        self.pulls_started = 0
        self._world[self.name] = self

    def fail_next(self, error: TransportError) -> None:
        self._fail_next = error

    @property
    def regions(self) -> tuple[KVRegion, ...]:
        return self._regions

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._check_registration(regions)
        self._regions = tuple(regions)

    def _address(self) -> dict[str, Any]:
        return {"name": self.name}

    def start_pull(self, req: PullRequest) -> None:
        self._admit_pull(req)
        if req.transfer_id in self._pending:
            raise InvalidPull(f"transfer {req.transfer_id!r} is already in flight")
        self.pulls_started += 1
        now = self._clock()
        timeout = req.timeout_s if req.timeout_s is not None else self._timeout_s
        peer = str(req.remote.get("name"))
        self._pending[req.transfer_id] = _Pending(req, peer, self._complete_after, now, now + timeout)

    def poll(self) -> list[PullResult]:
        if self._closed:
            return []
        now = self._clock()
        for tid, p in list(self._pending.items()):
            p.polls_left -= 1
            if p.polls_left > 0:
                if now >= p.deadline:
                    del self._pending[tid]
                    err = PullTimeout(f"pull {tid} from {p.peer} still pending after {now - p.started:.3f}s")
                    self._ready.append(PullResult.failure(tid, err, elapsed_s=now - p.started))
                continue
            del self._pending[tid]
            self._ready.append(self._complete(p, now))
        out, self._ready = self._ready, []
        return out

    def drain_served(self) -> list[str]:
        out, self._served = self._served, []
        return out

    def _close_engine(self) -> None:
        self._pending.clear()
        self._world.pop(self.name, None)

    def _complete(self, p: _Pending, now: float) -> PullResult:
        tid = p.req.transfer_id
        if self._fail_next is not None:
            err, self._fail_next = self._fail_next, None
            return PullResult.failure(tid, err, elapsed_s=now - p.started)
        peer = self._world.get(p.peer)
        if peer is None or peer._closed:
            return PullResult.failure(
                tid, PeerUnreachable(f"memory peer {p.peer!r} is gone"), elapsed_s=now - p.started
            )
        nbytes = 0
        if p.req.ranges is not None:  # a sub-block pull: exactly these bytes
            for r in p.req.ranges:
                ctypes.memmove(r.dst_addr, r.src_addr, r.nbytes)
                nbytes += r.nbytes
        else:
            for i in p.req.region_indexes(len(self._regions)):
                local, remote = self._regions[i], peer._regions[i]
                for src, dst in zip(p.req.remote_block_ids, p.req.local_block_ids, strict=True):
                    ctypes.memmove(local.block_addr(dst), remote.block_addr(src), local.block_len)
                    nbytes += local.block_len
        peer._served.append(tid)
        return PullResult.success(tid, nbytes=nbytes, elapsed_s=now - p.started)

    def _label(self) -> str:
        return f"memory transport {self.name}"

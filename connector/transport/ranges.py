"""The pre-flight check of a sub-block pull (`PullRequest.ranges`): explicit byte ranges instead of blocks.

A decode whose TP differs from the prefill's over sharded KV reads parts of the prefill's blocks (each of
its KV heads from the rank that holds it, `pdgate.connector.blocks.hetero_reads`), so the two sides'
blocks differ in size and the whole-block check (`base.check_pull_against`) does not apply. What still
must hold, or the engine would read or write memory nobody registered: every range lies inside the
memory the peer registered, and inside ours. Checked against the merged extents (`base.merge_extents`),
because ranges merged across adjacent layers' blocks span two regions of one buffer.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

from pdgate.connector.transport.errors import InvalidPull

if TYPE_CHECKING:
    from pdgate.connector.transport.base import PullRequest

__all__ = ["check_ranges"]


def check_ranges(req: PullRequest, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    """InvalidPull naming the first of `req.ranges` that is empty or leaves the registered `(start, length)`
    extents (address order, as `merge_extents` gives them) on either side, or that writes bytes another
    range writes."""
    ranges = req.ranges or ()
    if not ranges:
        raise InvalidPull("empty pull: no byte ranges given")
    if req.regions is not None:
        raise InvalidPull("a pull names byte ranges or regions, not both")
    for i, r in enumerate(ranges):
        if r.nbytes <= 0:
            raise InvalidPull(f"ranges[{i}] has {r.nbytes} bytes")
        if not _inside(r.src_addr, r.nbytes, remote):
            raise InvalidPull(f"ranges[{i}] reads {r.nbytes} B at {r.src_addr:#x}, outside the peer's KV regions")
        if not _inside(r.dst_addr, r.nbytes, local):
            raise InvalidPull(f"ranges[{i}] writes {r.nbytes} B at {r.dst_addr:#x}, outside our KV regions")
    spans = sorted((r.dst_addr, r.dst_addr + r.nbytes) for r in ranges)
    for (_, end), (start, _) in pairwise(spans):
        if start < end:
            raise InvalidPull(f"two ranges write the bytes at {start:#x}; one destination, two sources")


def _inside(addr: int, nbytes: int, extents: Sequence[tuple[int, int]]) -> bool:
    i = bisect_right([start for start, _ in extents], addr) - 1
    return i >= 0 and addr + nbytes <= extents[i][0] + extents[i][1]

"""Quantiles of a Prometheus histogram, as `histogram_quantile` computes them: the one rule the router's
status page (`router/status.py`) and `pdgate top` (`cli/`) both use, so they show the same numbers.

A histogram is its cumulative buckets: (upper bound, count of observations <= bound), the last bound
+Inf. A window of time is the difference of two readings (`window`). Pure: data in, data out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Buckets", "quantile", "window"]

Buckets = Sequence[tuple[float, float]]  # (le, cumulative count), ascending, last le = +Inf


def window(new: Buckets, old: Buckets | None) -> list[tuple[float, float]]:
    """The observations between two readings of one histogram (a counter reset: the new reading)."""
    if not old or len(old) != len(new) or new[-1][1] < old[-1][1]:
        return list(new)
    return [(le, n - o) for (le, n), (_, o) in zip(new, old, strict=True)]


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0..1) by linear interpolation inside its bucket; None with no observation.
    A quantile in the +Inf bucket is the highest finite bound (as Prometheus answers)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lower_le
            if n == lower_n:
                return le
            return lower_le + (le - lower_le) * (rank - lower_n) / (n - lower_n)
        lower_le, lower_n = le, n
    return lower_le

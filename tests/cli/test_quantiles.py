"""pdgate/histo.py: the quantile rule `pdgate top` and the status page share (Prometheus's
histogram_quantile: linear inside the bucket, the +Inf bucket answered by the highest finite bound)."""

from __future__ import annotations

import math

import pytest

from pdgate.histo import quantile, window

INF = math.inf


def test_linear_inside_the_bucket() -> None:
    b = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (INF, 20.0)]
    assert quantile(0.5, b) == 0.2  # rank 10: the top of (0.1, 0.2]
    assert quantile(0.25, b) == pytest.approx(0.15)  # rank 5: halfway through (0.1, 0.2]
    assert quantile(0.75, b) == pytest.approx(0.3)  # rank 15: halfway through (0.2, 0.4]


def test_no_observation_and_the_inf_bucket() -> None:
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert quantile(0.5, []) is None
    assert quantile(0.99, [(0.1, 1.0), (INF, 5.0)]) == 0.1


def test_a_window_is_the_difference_of_two_readings() -> None:
    old = [(0.1, 2.0), (INF, 3.0)]
    new = [(0.1, 2.0), (INF, 7.0)]
    assert window(new, old) == [(0.1, 0.0), (INF, 4.0)]
    assert window(new, None) == new
    assert window(old, new) == old  # a counter reset (a restarted router): the new reading alone

"""Where the decider's threshold comes from: SLO attainment by prompt length, PD against colocated.

The conditional decider sends a request through PD from `--pd-min-tokens` non-cached prompt tokens
(router/decider.py). Issue #22 asks for that default to come from the W1-W3 measurements, not a guess. Each
point of the goodput run keeps its requests as [prompt tokens, good] (`goodput_plan.rescore`), so the run
itself says, per prompt-length bin, which share of the requests met both SLOs on colocated replicas and
which on PD. The break-even is the lowest bin edge from which PD meets the SLOs at least as often as
colocated in every longer bin: below it a prompt is better served whole.

Only the rates both setups ran count (the first run of each; repeats and growth differ per setup), so
neither setup's share includes load the other never saw. Each request is scored against its own
workload's SLOs, which are multiples of colocated's unloaded latency for that workload: "good" means the
same thing in every bin. A bin with fewer than `MIN_REQUESTS` requests on either side says nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from goodput_plan import THRESHOLD_WORKLOADS

__all__ = ["BINS", "MIN_REQUESTS", "attainment", "break_even", "measured_threshold", "threshold_section"]

BINS: tuple[int, ...] = (0, 256, 512, 1024, 1536, 2048, 1 << 30)  # prompt-token bin edges
MIN_REQUESTS = 5
Bin = tuple[int, int]  # good, sent


def _common_points(result: dict[str, Any], setup: str, other: str, w: str) -> list[dict[str, Any]]:
    """`setup`'s first run at each rate `other` ran too, for workload `w`."""

    def points(s: str) -> list[dict[str, Any]]:
        entry = result["setups"].get(s) or {}
        return list(((entry.get("workloads") or {}).get(w) or {}).get("points") or [])

    theirs = {p["rate"] for p in points(other)}
    seen: set[float] = set()
    out = []
    for p in points(setup):
        if p["rate"] in theirs and p["rate"] not in seen:
            seen.add(p["rate"])
            out.append(p)
    return out


def _bin_of(tokens: int) -> int:
    for k in range(len(BINS) - 1):
        if BINS[k] <= tokens < BINS[k + 1]:
            return k
    return len(BINS) - 2


def attainment(rows: Iterable[Sequence[int]]) -> list[Bin]:
    """(good, sent) per bin of `BINS` from [prompt tokens, good] rows."""
    out = [(0, 0)] * (len(BINS) - 1)
    for tokens, good in rows:
        k = _bin_of(int(tokens))
        g, n = out[k]
        out[k] = (g + int(bool(good)), n + 1)
    return out


def _share(b: Bin) -> float | None:
    return b[0] / b[1] if b[1] >= MIN_REQUESTS else None


def break_even(colocated: Sequence[Bin], pd: Sequence[Bin]) -> int | None:
    """The lowest bin edge from which PD's share of good requests is at least colocated's in every longer
    bin that both measured; None when PD is behind in the longest measured bin (PD never pays)."""
    edge: int | None = None
    for k in reversed(range(len(BINS) - 1)):
        c, p = _share(colocated[k]), _share(pd[k])
        if c is None or p is None:
            continue
        if p < c:
            break
        edge = BINS[k]
    return edge


def measured_threshold(result: dict[str, Any], never: int) -> int | None:
    """The `--pd-min-tokens` this run's colocated and PD numbers imply: the break-even, or `never` (a length
    no prompt reaches: nothing goes PD) when PD met the SLOs less often at every measured length; None when
    the run has no bin both measured (one of them did not run), so the caller keeps its default."""
    colo = attainment(_rows(result, "colocated", "pd"))
    pd = attainment(_rows(result, "pd", "colocated"))
    if not any(_share(c) is not None and _share(p) is not None for c, p in zip(colo, pd, strict=True)):
        return None
    edge = break_even(colo, pd)
    return never if edge is None else edge


def _rows(result: dict[str, Any], setup: str, other: str) -> list[Sequence[int]]:
    rows: list[Sequence[int]] = []
    for w in THRESHOLD_WORKLOADS:
        for p in _common_points(result, setup, other, w):
            rows += p.get("requests") or []
    return rows


def _cell(b: Bin) -> str:
    g, n = b
    return "-" if n == 0 else f"{g}/{n} ({100 * g / n:.0f} %)"


def _label(k: int) -> str:
    lo, hi = BINS[k], BINS[k + 1]
    return f"{lo:,}+" if hi >= BINS[-1] else f"{lo:,}-{hi - 1:,}"


def threshold_section(result: dict[str, Any], pd_min_tokens: int | None) -> list[str]:
    """The bins, the break-even it implies and how the default compares; [] when no point kept requests."""
    colo = attainment(_rows(result, "colocated", "pd"))
    pd = attainment(_rows(result, "pd", "colocated"))
    if not any(n for _, n in colo) or not any(n for _, n in pd):
        return []
    cond = attainment(_rows(result, "conditional", "colocated"))
    edge = break_even(colo, pd)
    lines = [
        "## Where the decider's threshold comes from",
        "",
        "Share of requests that met both SLOs, by prompt length, over W1-W3 at the rates both colocated and PD "
        f"ran (bench/goodput_threshold.py; bins with fewer than {MIN_REQUESTS} requests on a side say nothing). "
        "The break-even is the lowest edge from which PD meets the SLOs at least as often as colocated in every "
        "longer bin.",
        "",
        "| prompt tokens | colocated good/sent | pd good/sent | conditional good/sent |",
        "|---|---:|---:|---:|",
    ]
    for k in range(len(BINS) - 1):
        if colo[k][1] or pd[k][1] or cond[k][1]:
            lines.append(f"| {_label(k)} | {_cell(colo[k])} | {_cell(pd[k])} | {_cell(cond[k])} |")
    lines.append("")
    used = f"`--pd-min-tokens {pd_min_tokens}`" if pd_min_tokens is not None else "its `--pd-min-tokens`"
    source = result.get("config", {}).get("pd_min_tokens_from", "")
    how = " (measured in this run, before the conditional setup started)" if source == "measured" else ""
    if edge is None:
        lines.append(
            "Measured break-even: none. PD met the SLOs less often than colocated even in the longest bin this "
            "run measured, so on this host a prompt of any measured length is better served whole; the "
            f"conditional setup ran with {used}{how}."
        )
    else:
        lines.append(f"Measured break-even: {edge:,} prompt tokens. The conditional setup ran with {used}{how}.")
    return lines

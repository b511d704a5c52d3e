"""The pure parts of `bench/multiturn.py`: one request's record, the decode logs' loads, the summary per
setup and the table (no engine is needed for any of it; tests/unit/test_multiturn_bench.py)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["SETUPS", "Turn", "loaded_tokens", "summarize", "table", "targets"]

SETUPS = ("round-robin", "kv-events", "kv-conditional")

# pdgate's decode connector, once per KV load (connector/decode_recv.py).
_LOADED = re.compile(r"transfer (\S+?): \S+ loaded (\d+) tokens")


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    ttft_s: float | None
    tokens: int
    rid: str
    path: str  # "pd" or "whole" (X-PDGate-Path)
    error: str = ""
    conversation: int = 0
    turn: int = 0
    loaded: int | None = None  # tokens the decode loaded for it (None: no load logged)

    def numbered(self, conversation: int, turn: int) -> Turn:
        return replace(self, conversation=conversation, turn=turn)

    def with_loaded(self, loaded: int | None) -> Turn:
        return replace(self, loaded=loaded)

    @property
    def moved_share(self) -> float:
        """KV moved for this request as a share of a full-prompt transfer (prompt - 1 tokens); whole: 0."""
        full = max(self.prompt_tokens - 1, 1)
        return (self.loaded or 0) / full

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def loaded_tokens(logs: Iterable[str]) -> dict[str, int]:
    """Request id -> tokens its decode loaded, from the decodes' logs (a retried load: the last one)."""
    out: dict[str, int] = {}
    for text in logs:
        for m in _LOADED.finditer(text):
            out[m.group(1)] = int(m.group(2))
    return out


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(turns: list[Turn]) -> dict[str, Any]:
    """TTFT p50/p99 over every good request and over turns 2+, KV moved per turn (mean share of a full
    prompt, all turns and turns 2+), the paths taken and the failures."""
    good = [t for t in turns if not t.error and t.ttft_s is not None]
    later = [t for t in good if t.turn >= 2]
    ms = [t.ttft_s * 1000 for t in good if t.ttft_s is not None]
    ms_later = [t.ttft_s * 1000 for t in later if t.ttft_s is not None]
    return {
        "requests": len(turns),
        "failed": len(turns) - len(good),
        "ttft_p50_ms": _p(ms, 0.5),
        "ttft_p99_ms": _p(ms, 0.99),
        "ttft_p50_ms_turns_2plus": _p(ms_later, 0.5),
        "moved_share": statistics.fmean(t.moved_share for t in good) if good else None,
        "moved_share_turns_2plus": statistics.fmean(t.moved_share for t in later) if later else None,
        "paths": {p: sum(t.path == p for t in good) for p in sorted({t.path for t in good})},
    }


def targets(doc: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """W4's two targets as (what, measured, met) against round robin in the same run."""
    s = doc["setups"]
    if "round-robin" not in s or "kv-events" not in s:
        return []
    rr, kv = s["round-robin"]["summary"], s["kv-events"]["summary"]
    out: list[tuple[str, str, bool | None]] = []
    # KV events alone (PD for every turn), then with the conditional decider (a turn whose uncached part is
    # short stays whole where its prefix lives): both are "with KV events", and each is said on its own.
    for name, what in (("kv-events", "KV events"), ("kv-conditional", "KV events and the conditional decider")):
        mine = s[name]["summary"] if name in s else None
        if not rr["ttft_p50_ms"] or mine is None or mine["ttft_p50_ms"] is None:
            continue
        ratio = mine["ttft_p50_ms"] / rr["ttft_p50_ms"]
        out.append(
            (
                f"TTFT p50 with {what} <= 0.6x round-robin PD",
                f"{mine['ttft_p50_ms']:.0f} / {rr['ttft_p50_ms']:.0f} ms = {ratio:.2f}x",
                ratio <= 0.6,
            )
        )
    if kv["moved_share_turns_2plus"] is not None:
        # Judged on the turns that extend a conversation: turn 1 has nothing cached anywhere, so it is a
        # full-prompt transfer in every setup and says nothing about routing (its share is in the first number).
        later = kv["moved_share_turns_2plus"]
        out.append(
            (
                "KV moved per later turn (2+) with KV events <= 0.3x a full-prompt transfer",
                f"{later:.2f}x over turns 2+ (round robin {rr['moved_share_turns_2plus']:.2f}x); "
                f"{kv['moved_share']:.2f}x over all turns, turn 1's full transfer included",
                later <= 0.3,
            )
        )
    return out


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(doc: dict[str, Any]) -> str:
    """The summary per setup, then the targets, as Markdown."""
    lines = [
        "| setup | requests | failed | TTFT p50 / p99 ms | TTFT p50 turns 2+ ms | KV moved per turn (x full prompt) "
        "| turns 2+ | paths | load avg before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, res in doc["setups"].items():
        s = res["summary"]
        paths = ", ".join(f"{p} {n}" for p, n in s["paths"].items())
        lines.append(
            f"| {name} | {s['requests']} | {s['failed']} | {_f(s['ttft_p50_ms'])} / {_f(s['ttft_p99_ms'])} "
            f"| {_f(s['ttft_p50_ms_turns_2plus'])} | {_f(s['moved_share'], '{:.2f}')} "
            f"| {_f(s['moved_share_turns_2plus'], '{:.2f}')} | {paths} "
            f"| {_f(res.get('load_before'), '{:.1f}')} / {_f(res.get('load_after'), '{:.1f}')} |"
        )
    met = targets(doc)
    if met:
        lines += ["", "| W4 target | measured | met |", "|---|---|---|"]
        for what, measured, ok in met:
            lines.append(f"| {what} | {measured} | {'yes' if ok else '**no**'} |")
    return "\n".join(lines)

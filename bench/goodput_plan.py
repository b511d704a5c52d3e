"""The goodput benchmark's plan and its pure parts: workloads, setups, the rate ladder, the time estimate,
the datasets and the re-scoring of vLLM's per-request results (no engine is needed for any of it).

Why each rule (see /work/shared/reference/goodput-method.md for the first sweep's traps):
- Prompts are uniformly random token ids, decoded to text and written as vLLM's custom dataset (JSONL):
  vLLM's `random` dataset builds prompts from consecutive ids at a random offset, and on the tiny model's
  2,048-token vocabulary prompts share whole prefixes that the prefix cache then serves. Random ids
  re-encode into more tokens than were drawn (about 1.17x), so each prompt is trimmed until its
  re-encoding fits the target length.
- Every request is re-scored from the per-request lists (`--save-detailed`): vLLM's client counts a
  stream cut after its first token as a success with TPOT 0, so a request is good only with all its
  requested tokens, a TTFT within the TTFT SLO and a TPOT within the TPOT SLO.
- Rates are multiples of the colocated setup's unloaded capacity (replicas / one request's unloaded
  service time), so one ladder runs from light load to past the knee for short and long prompts alike;
  the ladder grows while the last rate still met the SLOs, and the best point is run again (single-run
  peaks near the knee did not reproduce).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BURST_RUNS",
    "HEARTBEAT_S",
    "LOW_SHARE",
    "PAIRED",
    "REPEAT_SHARE",
    "REPORT_FRESH_S",
    "SETTLE_S",
    "SETUPS",
    "SHARED_ENGINES",
    "THRESHOLD_WORKLOADS",
    "WORKLOADS",
    "Cell",
    "Mode",
    "Plan",
    "Slo",
    "Workload",
    "cells",
    "dataset_texts",
    "estimate_s",
    "plan_lines",
    "point_s",
    "remaining_s",
    "rescore",
    "slo_from_unloaded",
    "unloaded_figures",
    "write_dataset",
]

OUTPUT_TOKENS = 64
REENCODE = 1.17  # random ids re-encode into about this many tokens (measured on the tiny model's tokenizer)
FIRST_ORDINARY_TOKEN = 3  # 0-2 are <|bos|> <|eos|> <|pad|>
TTFT_FACTOR = 4.0  # TTFT SLO = this x the colocated unloaded TTFT p50 of the workload
TPOT_FACTOR = 3.0  # TPOT SLO = this x the colocated unloaded TPOT p50


@dataclass(frozen=True)
class Workload:
    """One kind of traffic: prompt lengths (or conversations) and how it arrives."""

    name: str
    title: str
    lengths: tuple[int, int] = (128, 128)  # prompt tokens drawn uniformly in [lo, hi]
    turns: int = 0  # > 0: conversations whose turns share a growing prefix
    burst: int = 0  # > 0: this many requests at once (rate inf, this max concurrency); no ladder


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "long prompts (~2,048 tokens), 64 out", (2048, 2048)),
    "W2": Workload("W2", "short chat (128 in, 64 out)", (128, 128)),
    "W3": Workload("W3", "mixed (50-2,000 in, 64 out)", (50, 2000)),
    "W4": Workload("W4", "multi-turn: 4 turns sharing a growing prefix (512 + 320 per turn), 64 out", turns=4),
    "burst": Workload("burst", "the seed's case: 256 requests at once (256 in, 64 out)", (256, 256), burst=256),
}

SETUPS: dict[str, str] = {
    "colocated": "colocated: 2 plain vLLM replicas behind pdgate-router (role both, served whole)",
    "pd": "pdgate PD 1P1D (PDGateConnector over NIXL, router with embedded metaserver)",
    "conditional": "pdgate conditional (--disaggregation conditional), the same 1P1D engines",
    "nixl": "vLLM NixlConnector 1P1D behind pdgate-router (stock engines)",
}


@dataclass(frozen=True)
class Mode:
    """How much to run: the default fits 20 minutes on a 2-core machine; quick is the CI check."""

    name: str
    setups: tuple[str, ...]
    workloads: tuple[str, ...]
    rate_factors: tuple[float, ...]  # x the colocated unloaded capacity
    window_s: float  # arrival window of one point: prompts = max(min_prompts, rate x window)
    min_prompts: int
    extend: int  # extra rates (x2 each) while the last one still met the SLOs
    repeats: int  # extra runs of the best point
    probe_prompts: int  # unloaded requests per workload (one at a time) that set the SLOs


DEFAULT = Mode(
    "default",
    tuple(SETUPS),
    tuple(WORKLOADS),
    rate_factors=(0.3, 0.8),
    window_s=8.0,
    min_prompts=6,
    extend=1,
    repeats=1,
    probe_prompts=8,  # with 4, W2's unloaded TTFT p50 read 19 ms in one run and 69 ms in the next
)
QUICK = Mode(
    "quick",
    ("conditional",),
    ("W3",),
    rate_factors=(0.5,),
    window_s=6.0,
    min_prompts=6,
    extend=0,
    repeats=0,
    probe_prompts=2,
)
MODES = {"default": DEFAULT, "quick": QUICK}

# Time model of the estimate (2 cores, tiny model; from bench/e2e.py and the full runs).
START_S = {"paired": 90.0, "nixl": 60.0}  # colocated's replicas and pd's engines start at once (measured: 87 s, 55 s)
FIXED_S = 35.0  # importing vLLM's client, the tokenizer, the model build check
WARMUP_S = 10.0  # per setup: a few unscored requests
SERVICE_S = {"W1": 1.1, "W2": 0.6, "W3": 0.8, "W4": 0.9, "burst": 0.6}  # one request, unloaded
POINT_OVERHEAD_S = 1.0  # vLLM's test request, dataset load, scrapes (a point took its window + 1.5-2 s)
EXTEND_ODDS = 0.5  # a growth point runs only while the last rate met the SLOs
BURST_S = 25.0
BURST_RUNS = 2  # a burst is one run of 256 requests: each setup runs it twice, taking turns
SLOWER = {"nixl": 2.0}  # the stock pair's points run this much longer (its queue drains at ~0.3 req/s on W1)

# The setups that serve side by side, each on the same two cores, and take turns point by point; the stock
# NIXL pair starts on its own afterwards (its engines would be a third pair on the cores' memory).
PAIRED = ("colocated", "pd", "conditional")
# The workloads the conditional threshold is measured on (random prompts: W4's turns hit the prefix cache).
THRESHOLD_WORKLOADS = ("W1", "W2", "W3")
# Before a workload's unloaded probe: vLLM's shared-memory queue readers (engine core and worker) spin for
# 1 s after their last message, so the engines of the point just run still hold both cores meanwhile.
SETTLE_S = 2.0
# pd and conditional run on the same engines, each through its own router. An engine's load report,
# taken during one setup's point, reaches the other setup's router as another router's requests
# (`pool.LiveInstance.others`) until the next heartbeat: one engine looks busy and the other gets the
# next point's first requests. So pd's engines heartbeat every HEARTBEAT_S, and a point that follows one
# on the same engines starts once a report taken after it has been read (a heartbeat and a registry poll).
HEARTBEAT_S = 1.0
SHARED_ENGINES = frozenset({"pd", "conditional"})
REPORT_FRESH_S = HEARTBEAT_S + 1.0  # the routers read the registry every second (`--refresh-interval-s`)
LOW_SHARE = 0.25  # a setup meeting the SLOs for fewer of a point's requests runs no higher rate
REPEAT_SHARE = 0.5  # the best point is repeated when within this share of colocated's: a close call


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def goodput_arg(self) -> list[str]:
        """vLLM's `--goodput` values."""
        return [f"ttft:{self.ttft_ms:.0f}", f"tpot:{self.tpot_ms:.1f}"]


def slo_from_unloaded(ttft_ms: float, tpot_ms: float) -> Slo:
    return Slo(TTFT_FACTOR * ttft_ms, TPOT_FACTOR * tpot_ms)


def capacity(replicas: int, ttft_ms: float, tpot_ms: float, out: int = OUTPUT_TOKENS) -> float:
    """Requests per second `replicas` engines finish one at a time, unloaded: the ladder's unit."""
    service_s = (ttft_ms + (out - 1) * tpot_ms) / 1e3
    return replicas / max(service_s, 1e-3)


def prompts_for(rate: float, mode: Mode) -> int:
    return max(mode.min_prompts, math.ceil(rate * mode.window_s))


@dataclass(frozen=True)
class Plan:
    mode: Mode
    setups: tuple[str, ...]
    workloads: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"mode": asdict(self.mode), "setups": list(self.setups), "workloads": list(self.workloads)}


def points_per_cell(m: Mode) -> float:
    return len(m.rate_factors) + EXTEND_ODDS * m.extend + m.repeats


def point_s(m: Mode, workload: str) -> float:
    """One point: its arrival window, then the queue's drain (a service time or two past the knee)."""
    return m.window_s + 1.5 * SERVICE_S[workload] + POINT_OVERHEAD_S


@dataclass(frozen=True)
class Cell:
    """One workload run on one group of setups taking turns: each rate is run on every setup, one after
    the other, before the next rate, so the host's drift (its speed moved by 30 % within hours here) falls
    on all of them alike."""

    workload: str
    setups: tuple[str, ...]


def cells(plan: Plan) -> list[Cell]:
    """The run's order. colocated and pd take turns on W1-W3 first: the conditional threshold is measured
    from them (bench/goodput_threshold.py). Then the conditional router starts, and W1-W3 run again on it
    and colocated (colocated's second runs average with its first), then W4 and the burst on all three. The
    stock NIXL pair comes last, alone."""
    paired = [s for s in PAIRED if s in plan.setups]
    first = tuple(s for s in paired if s != "conditional")
    measured = [w for w in plan.workloads if w in THRESHOLD_WORKLOADS]
    out: list[Cell] = []
    if "conditional" in paired:
        out += [Cell(w, first) for w in measured if first]
        out += [Cell(w, tuple(s for s in paired if s != "pd")) for w in measured]
        out += [Cell(w, tuple(paired)) for w in plan.workloads if w not in measured]
    elif paired:
        out += [Cell(w, tuple(paired)) for w in plan.workloads]
    for s in plan.setups:
        if s not in PAIRED:
            out += [Cell(w, (s,)) for w in plan.workloads]
    return out


def _setup_cell_s(m: Mode, setup: str, workload: str, points: float) -> float:
    slower = SLOWER.get(setup, 1.0)
    return slower * (BURST_RUNS * BURST_S if WORKLOADS[workload].burst else points * point_s(m, workload))


def _mandatory_s(m: Mode, cell: Cell) -> float:
    return sum(_setup_cell_s(m, s, cell.workload, len(m.rate_factors)) for s in cell.setups)


def _starts_s(setups: Sequence[str]) -> float:
    paired = [s for s in setups if s in PAIRED]
    alone = [s for s in setups if s not in PAIRED]
    return (START_S["paired"] if paired else 0.0) + sum(START_S[s] for s in alone) + WARMUP_S * len(setups)


def remaining_s(plan: Plan, index: int) -> float:
    """Mandatory work left after cell `index` of `cells(plan)`: the later cells' ladders and bursts and the
    starts of setups not yet serving. Optional points (growth, repeats) run only while it fits."""
    order = cells(plan)
    started = {s for c in order[: index + 1] for s in c.setups}
    later = order[index + 1 :]
    total = _starts_s(sorted({s for c in later for s in c.setups} - started - set(PAIRED)))
    return total + sum(_mandatory_s(plan.mode, c) for c in later)


def estimate_s(plan: Plan) -> float:
    """Seconds the plan should take here (engine starts, probes, every point, the repeats)."""
    m = plan.mode
    total = FIXED_S + _starts_s(plan.setups)
    for w in plan.workloads:  # the first setup's unloaded probe (the SLOs), after the settle
        total += SETTLE_S + m.probe_prompts * SERVICE_S[w] + POINT_OVERHEAD_S
    seen: set[tuple[str, str]] = set()
    for c in cells(plan):
        for s in c.setups:
            # A setup's second pass at a workload (colocated beside conditional) repeats no rate: its
            # first pass ran each rate once already.
            again = (s, c.workload) in seen
            points = len(m.rate_factors) + EXTEND_ODDS * m.extend if again else points_per_cell(m)
            if s not in PAIRED:  # the stock pair: never a close call (no repeat), rarely past its first rate
                points = len(m.rate_factors)
            total += _setup_cell_s(m, s, c.workload, points)
            seen.add((s, c.workload))
    return total


def plan_lines(plan: Plan) -> list[str]:
    """The dry run's printout: setups x workloads x rates and the estimate."""
    m = plan.mode
    ladder = ", ".join(f"{f:g}" for f in m.rate_factors)
    out = [f"mode {m.name}: {len(plan.setups)} setups x {len(plan.workloads)} workloads"]
    out += [f"  setup {s}: {SETUPS[s]}" for s in plan.setups]
    for w in plan.workloads:
        wl = WORKLOADS[w]
        if wl.burst:
            out.append(
                f"  {w}: {wl.title}: {BURST_RUNS} bursts of {wl.burst} per setup, taking turns (rate inf, "
                f"max concurrency {wl.burst})"
            )
        else:
            out.append(
                f"  {w}: {wl.title}: Poisson rates x{{{ladder}}} of colocated's unloaded capacity, "
                f"+{m.extend} doubling while the SLOs hold, +{m.repeats} repeat of the best; "
                f"prompts per point max({m.min_prompts}, rate x {m.window_s:g} s)"
            )
    out.append(
        f"  SLOs per workload: TTFT {TTFT_FACTOR:g}x and TPOT {TPOT_FACTOR:g}x colocated's unloaded p50 "
        f"({m.probe_prompts} requests one at a time)"
    )
    out.append("  order (setups in a group take turns at each rate):")
    out += [f"    {c.workload}: {' / '.join(c.setups)}" for c in cells(plan)]
    est = estimate_s(plan)
    out.append(f"estimate: {est / 60:.1f} min ({est:.0f} s) on a 2-core machine with the tiny model")
    return out


# -- datasets ----------------------------------------------------------------------------------

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def random_text(rng: random.Random, target: int, vocab: int, encode: Encode, decode: Decode) -> str:
    """Text of uniformly random token ids whose re-encoding is at most `target` tokens (and close to it)."""
    ids = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(max(1, round(target / REENCODE)))]
    for _ in range(4):
        text = decode(ids)
        n = len(encode(text))
        if n <= target:
            return text
        ids = ids[: max(1, int(len(ids) * target / n) - 1)]
    return decode(ids)


def dataset_texts(workload: str, n: int, seed: int, vocab: int, encode: Encode, decode: Decode) -> list[str]:
    """`n` prompts of `workload`, reproducible from `seed`. Multi-turn: turn t of a conversation is its
    512-token opening plus t x (256 user + 64 answer) tokens, listed turn by turn (every first turn, then
    every second...), so with the dataset unshuffled each turn arrives after the one whose prefix it extends."""
    wl = WORKLOADS[workload]
    rng = random.Random(f"goodput-{workload}-{seed}")
    if not wl.turns:
        lo, hi = wl.lengths
        return [random_text(rng, rng.randint(lo, hi), vocab, encode, decode) for _ in range(n)]
    convs = max(1, math.ceil(n / wl.turns))
    history = [random_text(rng, 512, vocab, encode, decode) for _ in range(convs)]
    out: list[str] = []
    for _turn in range(wl.turns):
        for c in range(convs):
            history[c] += random_text(rng, 256, vocab, encode, decode)
            out.append(history[c])
        for c in range(convs):
            history[c] += random_text(rng, 64, vocab, encode, decode)  # the "answer" the next turn carries
    return out[:n]


def write_dataset(path: Path, texts: Sequence[str], output_tokens: int = OUTPUT_TOKENS) -> Path:
    """vLLM's custom dataset: one {"prompt", "output_tokens"} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": t, "output_tokens": output_tokens}) + "\n" for t in texts))
    return path


# -- scoring -----------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# A stream whose tokens reached the client with under this much between them, on average, arrived in one
# piece: no engine step of the tiny model takes under 1.5 ms. On this host a probe's stream sometimes does
# (its TTFT then is the whole answer's time and its TPOT ~0.004 ms): one run's W2 probe had 6 of 8 so,
# which made the TPOT SLO 0.0 ms and every W2 point fail it.
COALESCED_TPOT_MS = 0.1


def _timings(result: dict[str, Any], want_tokens: int) -> list[tuple[int, tuple[float, float] | None]]:
    """Per request of vLLM's lists: its prompt tokens, and (TTFT ms, TPOT ms) when it is complete (no
    error and every requested token), else None. The one rule `rescore` and `unloaded_figures` share."""
    errors = result.get("errors") or []
    outs = result.get("output_lens") or []
    ttfts = result.get("ttfts") or []
    lats = result.get("latencies") or []
    ins = result.get("input_lens") or []
    out: list[tuple[int, tuple[float, float] | None]] = []
    for i in range(len(outs)):
        prompt = int(ins[i]) if i < len(ins) else 0
        if (errors[i] if i < len(errors) else "") or outs[i] < want_tokens:
            out.append((prompt, None))
        else:
            out.append((prompt, (ttfts[i] * 1e3, (lats[i] - ttfts[i]) * 1e3 / max(outs[i] - 1, 1))))
    return out


def unloaded_figures(result: dict[str, Any], want_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """The unloaded TTFT and TPOT p50 the SLOs are multiples of, over the probe's complete requests whose
    tokens streamed (`COALESCED_TPOT_MS`); over all of them when none did. `coalesced` says how many
    were left out."""
    done = [t for _, t in _timings(result, want_tokens) if t is not None]
    streamed = [t for t in done if t[1] >= COALESCED_TPOT_MS] or done
    return {
        "ttft_ms": _pct([t[0] for t in streamed], 50),
        "tpot_ms": _pct([t[1] for t in streamed], 50),
        "n": len(done),
        "coalesced": sum(t[1] < COALESCED_TPOT_MS for t in done),
    }


def rescore(result: dict[str, Any], slo: Slo, want_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """Goodput and latency percentiles from vLLM's per-request lists: complete = no error and every
    requested token; good = complete within both SLOs. TTFT/TPOT percentiles are over complete requests."""
    ttft_ms: list[float] = []
    tpot_ms: list[float] = []
    requests: list[list[int]] = []  # [prompt tokens, good 0/1] each: SLO attainment by prompt length
    good = 0
    timings = _timings(result, want_tokens)
    for prompt, t in timings:
        if t is None:
            requests.append([prompt, 0])
            continue
        ttft, tpot = t
        ttft_ms.append(ttft)
        tpot_ms.append(tpot)
        ok = ttft <= slo.ttft_ms and tpot <= slo.tpot_ms
        good += ok
        requests.append([prompt, int(ok)])
    n = len(timings)
    duration = float(result.get("duration") or 0.0) or float("nan")
    return {
        "sent": n,
        "complete": len(ttft_ms),
        "cut_or_failed": n - len(ttft_ms),
        "good": good,
        "goodput": good / duration,
        "throughput": len(ttft_ms) / duration,
        "vllm_goodput": result.get("request_goodput"),
        "duration_s": duration,
        "ttft_ms": {"p50": _pct(ttft_ms, 50), "p99": _pct(ttft_ms, 99)},
        "tpot_ms": {"p50": _pct(tpot_ms, 50), "p99": _pct(tpot_ms, 99)},
        "requests": requests,
    }

"""Conditional disaggregation: for each request, PD (prefill on a prefill, decode pulls the KV) or whole
(the decode instance runs the request alone), and why (issue #22 item 3). Pure: every input is passed in
(the candidates' state is a snapshot the caller took), like the policies; the caller counts the decision
(`RouterMetrics.decision`) and carries it out.

Why a threshold on the non-cached prompt. PD pays a fixed price per request: a second engine hop, the
handoff in the ledger, the KV transfer and the prefill's own queue. What it buys is a decode whose running
streams are not stalled by long prefills, and that only outweighs the price when the prefill is long.
Where the break-even lies depends on the hardware, so it is measured, not guessed: `bench/goodput.py`
scores every request against the SLOs and finds the prompt length from which PD meets them at least as
often as colocated replicas (`bench/goodput_threshold.py`; docs/PERFORMANCE.md), and runs its
conditional setup at that length. Measured on this project's CPU machine class: the first sweep put the
break-even between 128 and 2,048 tokens (~2,048-token prompts PD 1.0-1.2x colocated, 128-token 0.16-0.38x);
the 2026-12-07 run on an AVX2-only host found none up to 2,048 (PD behind at every length). The default,
1,024 non-cached tokens (`DeciderConfig.min_pd_tokens`), is the first sweep's lower half: on accelerators
the transfer is cheaper relative to the prefill and the interference PD removes grows with batch size,
both moving the break-even down, and llm-d's P/D decider and Dynamo's conditional disaggregation gate on
the same quantity with thresholds of that order. Deployments measure theirs and set `--pd-min-tokens`.

Non-cached, not prompt length. A prompt the candidate decode already holds mostly in its prefix cache costs
that decode little to prefill, so what counts is the prompt minus the decode's cached prefix (Dynamo:
"prefill locally when the decode already holds most of it"); the cached length comes from the KV-event
index (`kv_index.py`) and is 0 when events are off.

Order of the rules (first match wins), each a `Reason`:
  mode "always"/"never"       today's behaviour (always PD) or PD off, whatever the request
  no_prefill                  no prefill can take the request (none eligible, or no decode pairs with one)
  ledger_down                 the handoff ledger is known to be down: PD would fail, whole needs no ledger
  short_prompt                the prompt itself is under the threshold
  decode_cached               the prompt is long but the decode's cached prefix leaves less than the threshold
  prefill_busy                the prefill's queue is at `prefill_busy_load` and deeper than the decode's, or
                              its KV cache is at `prefill_kv_full` and fuller than the decode's (vLLM would
                              queue or preempt the new prompt there): PD would wait longer than running whole
  slo_ttft                    the client set x-slo-ttft-ms and the prefill's queue is deeper than the decode's
                              (PD's extra hop and queue count against TTFT)
  slo_tpot -> PD              the client set x-slo-tpot-ms at or under `strict_tpot_ms`: the threshold halves,
                              since a prefill run whole stalls the decode's streams for its duration
  long_prompt -> PD           the non-cached prompt reaches the threshold
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from pdgate.router.bodies import RequestFacts
from pdgate.router.policies import load_of
from pdgate.router.pool import LiveInstance
from pdgate.router.settings import RouterSettings

__all__ = [
    "PATH_REASONS",
    "SLO_HEADERS",
    "DeciderConfig",
    "Decision",
    "Inputs",
    "Path",
    "Reason",
    "SideState",
    "Slo",
    "config_from",
    "decide",
    "decide_early",
    "decide_request",
    "side",
    "slo_from_headers",
]

HEADER_TTFT = "x-slo-ttft-ms"
HEADER_TPOT = "x-slo-tpot-ms"
SLO_HEADERS = frozenset({HEADER_TTFT.encode(), HEADER_TPOT.encode()})  # as ASGI names them (bytes)


class Path(enum.Enum):
    PD = "pd"
    WHOLE = "whole"


class Reason(enum.Enum):
    ALWAYS = "always"
    NEVER = "never"
    NO_PREFILL = "no_prefill"
    LEDGER_DOWN = "ledger_down"
    SHORT_PROMPT = "short_prompt"
    DECODE_CACHED = "decode_cached"
    PREFILL_BUSY = "prefill_busy"
    SLO_TTFT = "slo_ttft"
    SLO_TPOT = "slo_tpot"
    LONG_PROMPT = "long_prompt"


# Every (path, reason) the decider can answer: the metric's label pairs, created at zero.
PATH_REASONS: tuple[tuple[Path, Reason], ...] = (
    (Path.PD, Reason.ALWAYS),
    (Path.WHOLE, Reason.NEVER),
    (Path.WHOLE, Reason.NO_PREFILL),
    (Path.WHOLE, Reason.LEDGER_DOWN),
    (Path.WHOLE, Reason.SHORT_PROMPT),
    (Path.WHOLE, Reason.DECODE_CACHED),
    (Path.WHOLE, Reason.PREFILL_BUSY),
    (Path.WHOLE, Reason.SLO_TTFT),
    (Path.PD, Reason.SLO_TPOT),
    (Path.PD, Reason.LONG_PROMPT),
)

MODES = ("always", "conditional", "never")


@dataclass(frozen=True, slots=True)
class DeciderConfig:
    mode: str = "always"  # today's behaviour until a deployment opts in (`--disaggregation conditional`)
    min_pd_tokens: int = 1024  # non-cached prompt tokens from which PD pays (module docstring)
    prefill_busy_load: float = 8.0  # a prefill this loaded (`policies.load_of`) and busier than the decode
    prefill_kv_full: float = 0.9  # a prefill whose reported KV use (0..1) is this high and above the decode's
    strict_tpot_ms: float = 50.0  # a TPOT SLO at or under this halves the threshold

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.min_pd_tokens < 0 or self.prefill_busy_load <= 0 or self.strict_tpot_ms <= 0:
            raise ValueError("thresholds must be positive")
        if not 0 < self.prefill_kv_full <= 1:
            raise ValueError("prefill_kv_full is a share of the KV cache, in (0, 1]")


# The per-request values are NamedTuples, not frozen dataclasses: built for every request on the router's
# hot path, where a frozen dataclass's __init__ (one object.__setattr__ a field) cost the decision 2-3 us.


class SideState(NamedTuple):
    """One candidate instance as the decider sees it: its load (`policies.load_of`) and KV use (0..1)."""

    id: str
    load: float
    kv_usage: float = 0.0


class Slo(NamedTuple):
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class Inputs(NamedTuple):
    prompt_tokens: int
    decode: SideState  # the decode chosen for the request (it runs it whole, or pulls the KV)
    prefill: SideState | None  # the best prefill that pairs with it; None: no prefill can take it
    decode_cached_tokens: int = 0  # leading prompt tokens the decode's prefix cache holds (KV events)
    ledger_ok: bool = True
    slo: Slo = Slo()


class Decision(NamedTuple):
    path: Path
    reason: Reason
    where: str  # the instance that runs the request whole, or the prefill of a PD request

    @property
    def labels(self) -> tuple[str, str]:
        return self.path.value, self.reason.value


def _threshold(cfg: DeciderConfig, slo: Slo) -> tuple[int, bool]:
    """The non-cached length from which PD pays for this request, and whether its TPOT SLO is strict."""
    strict_tpot = slo.tpot_ms is not None and slo.tpot_ms <= cfg.strict_tpot_ms
    return (cfg.min_pd_tokens // 2 if strict_tpot else cfg.min_pd_tokens), strict_tpot


def decide_early(
    cfg: DeciderConfig, prompt_tokens: int, whole_at: str, *, has_prefill: bool, ledger_ok: bool, slo: Slo
) -> Decision | None:
    """The rules that need neither the prefill's pick nor the decode's cache (mode "never", no_prefill,
    ledger_down, short_prompt), or None: `decide` must weigh the rest. The router asks this first, so that
    a request kept whole costs no prefill pick and no cache lookup; `decide` starts with it, so the order
    of the rules stays in one place."""
    if cfg.mode == "never":
        return Decision(Path.WHOLE, Reason.NEVER, whole_at)
    if cfg.mode == "always":
        return None
    if not has_prefill:
        return Decision(Path.WHOLE, Reason.NO_PREFILL, whole_at)
    if not ledger_ok:
        return Decision(Path.WHOLE, Reason.LEDGER_DOWN, whole_at)
    if prompt_tokens < _threshold(cfg, slo)[0]:
        return Decision(Path.WHOLE, Reason.SHORT_PROMPT, whole_at)
    return None


def decide(cfg: DeciderConfig, x: Inputs) -> Decision:
    """PD or whole for one request, the rule that decided and where it goes (module docstring)."""
    early = decide_early(
        cfg, x.prompt_tokens, x.decode.id, has_prefill=x.prefill is not None, ledger_ok=x.ledger_ok, slo=x.slo
    )
    if early is not None:
        return early
    p = x.prefill
    if p is None:  # mode "always" with no prefill: PD's own path names the error
        return Decision(Path.PD, Reason.ALWAYS, "")
    if cfg.mode == "always":
        return Decision(Path.PD, Reason.ALWAYS, p.id)
    threshold, strict_tpot = _threshold(cfg, x.slo)
    suffix = x.prompt_tokens - min(max(x.decode_cached_tokens, 0), x.prompt_tokens)
    if suffix < threshold:
        return Decision(Path.WHOLE, Reason.DECODE_CACHED, x.decode.id)
    queued = p.load >= cfg.prefill_busy_load and p.load > x.decode.load
    kv_full = p.kv_usage >= cfg.prefill_kv_full and p.kv_usage > x.decode.kv_usage
    if queued or kv_full:
        return Decision(Path.WHOLE, Reason.PREFILL_BUSY, x.decode.id)
    if x.slo.ttft_ms is not None and p.load > x.decode.load:
        return Decision(Path.WHOLE, Reason.SLO_TTFT, x.decode.id)
    if strict_tpot and suffix < cfg.min_pd_tokens:
        return Decision(Path.PD, Reason.SLO_TPOT, p.id)
    return Decision(Path.PD, Reason.LONG_PROMPT, p.id)


def _positive_ms(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def slo_from_headers(headers: Mapping[str, str]) -> Slo:
    """The request's SLO headers (as llm-d names them); a missing or malformed value is no SLO. Header
    names must be lower-case keys, as ASGI gives them."""
    return Slo(_positive_ms(headers.get(HEADER_TTFT)), _positive_ms(headers.get(HEADER_TPOT)))


def config_from(s: RouterSettings) -> DeciderConfig:
    """The decider's settings (`--disaggregation`, `--pd-min-tokens`, `--pd-prefill-busy-load`,
    `--pd-prefill-kv-full`)."""
    return DeciderConfig(
        mode=s.disaggregation,
        min_pd_tokens=s.pd_min_tokens,
        prefill_busy_load=s.pd_prefill_busy_load,
        prefill_kv_full=s.pd_prefill_kv_full,
    )


def side(inst: LiveInstance) -> SideState:
    """An instance as the decider sees it: the policies' load and its last reported KV use."""
    return SideState(inst.id, load_of(inst), inst.view.kv_usage)


def decide_request(
    cfg: DeciderConfig,
    req: RequestFacts,
    decode: LiveInstance,
    prefill: LiveInstance | None,
    *,
    cached_tokens: Callable[[LiveInstance, RequestFacts], int] | None = None,
    ledger_ok: bool = True,
    slo: Slo = Slo(),
) -> Decision:
    """`decide` for the router's own objects: the decode and prefill the policies chose (None: no prefill
    pairs with the decode), `cached_tokens` the KV-event lookup (`CacheAware.cached_tokens`; None when events
    are off), the ledger's state (not `Pool.ledger_down`) and the request's SLO headers (`slo_from_headers`).
    In mode "always" nothing is looked up: today's path costs nothing more."""
    if cfg.mode != "conditional":
        return decide(
            cfg, Inputs(req.prompt_tokens, SideState(decode.id, 0.0), None if prefill is None else side(prefill))
        )
    cached = cached_tokens(decode, req) if cached_tokens is not None else 0
    x = Inputs(req.prompt_tokens, side(decode), None if prefill is None else side(prefill), cached, ledger_ok, slo)
    return decide(cfg, x)

"""The PD-or-whole decider (router/decider.py): each reason, the order of the rules, the SLO headers."""

from __future__ import annotations

import pytest
from pdgate.router.decider import (
    PATH_REASONS,
    DeciderConfig,
    Inputs,
    Path,
    Reason,
    SideState,
    Slo,
    decide,
    decide_early,
    slo_from_headers,
)

COND = DeciderConfig(mode="conditional", min_pd_tokens=1024, prefill_busy_load=8.0, strict_tpot_ms=50.0)
D = SideState("d1", load=2.0, kv_usage=0.3)
P = SideState("p1", load=1.0, kv_usage=0.1)


def _x(prompt: int = 2048, **kw: object) -> Inputs:
    args: dict[str, object] = {"prompt_tokens": prompt, "decode": D, "prefill": P}
    args.update(kw)
    return Inputs(**args)  # type: ignore[arg-type]


def _reason(cfg: DeciderConfig, x: Inputs) -> tuple[Path, Reason, str]:
    d = decide(cfg, x)
    assert (d.path, d.reason) in PATH_REASONS  # every answer is a pre-registered metric label pair
    return d.path, d.reason, d.where


def test_default_mode_is_todays_behaviour_always_pd() -> None:
    assert _reason(DeciderConfig(), _x(prompt=10)) == (Path.PD, Reason.ALWAYS, "p1")


def test_never_runs_everything_whole_on_the_decode() -> None:
    assert _reason(DeciderConfig(mode="never"), _x()) == (Path.WHOLE, Reason.NEVER, "d1")


def test_long_prompt_goes_pd_to_the_prefill() -> None:
    assert _reason(COND, _x(prompt=1024)) == (Path.PD, Reason.LONG_PROMPT, "p1")


def test_short_prompt_runs_whole_on_the_decode() -> None:
    assert _reason(COND, _x(prompt=1023)) == (Path.WHOLE, Reason.SHORT_PROMPT, "d1")


def test_a_long_prompt_the_decode_mostly_holds_runs_whole() -> None:
    assert _reason(COND, _x(prompt=4096, decode_cached_tokens=3200)) == (Path.WHOLE, Reason.DECODE_CACHED, "d1")
    assert _reason(COND, _x(prompt=4096, decode_cached_tokens=3072)) == (Path.PD, Reason.LONG_PROMPT, "p1")


def test_no_prefill_and_ledger_down_run_whole_before_anything_else() -> None:
    assert _reason(COND, _x(prefill=None)) == (Path.WHOLE, Reason.NO_PREFILL, "d1")
    assert _reason(COND, _x(ledger_ok=False)) == (Path.WHOLE, Reason.LEDGER_DOWN, "d1")


def test_a_busy_prefill_busier_than_the_decode_runs_whole() -> None:
    busy = SideState("p1", load=8.0)
    assert _reason(COND, _x(prefill=busy)) == (Path.WHOLE, Reason.PREFILL_BUSY, "d1")
    # equally busy decode: PD still relieves it
    assert _reason(COND, _x(prefill=busy, decode=SideState("d1", load=9.0))) == (Path.PD, Reason.LONG_PROMPT, "p1")


def test_a_prefill_whose_kv_cache_is_full_runs_whole() -> None:
    full = SideState("p1", load=0.0, kv_usage=0.95)
    assert _reason(COND, _x(prefill=full)) == (Path.WHOLE, Reason.PREFILL_BUSY, "d1")
    # the decode as full: running whole there would wait as long
    assert _reason(COND, _x(prefill=full, decode=SideState("d1", 0.0, 0.97)))[:2] == (Path.PD, Reason.LONG_PROMPT)
    assert _reason(COND, _x(prefill=SideState("p1", 0.0, 0.85)))[:2] == (Path.PD, Reason.LONG_PROMPT)


def test_ttft_slo_avoids_a_deeper_prefill_queue() -> None:
    deeper = SideState("p1", load=3.0)
    assert _reason(COND, _x(prefill=deeper, slo=Slo(ttft_ms=500))) == (Path.WHOLE, Reason.SLO_TTFT, "d1")
    assert _reason(COND, _x(prefill=deeper)) == (Path.PD, Reason.LONG_PROMPT, "p1")
    assert _reason(COND, _x(slo=Slo(ttft_ms=500))) == (Path.PD, Reason.LONG_PROMPT, "p1")  # prefill lighter


def test_strict_tpot_slo_halves_the_threshold() -> None:
    strict = Slo(tpot_ms=40)
    assert _reason(COND, _x(prompt=600, slo=strict)) == (Path.PD, Reason.SLO_TPOT, "p1")
    assert _reason(COND, _x(prompt=500, slo=strict)) == (Path.WHOLE, Reason.SHORT_PROMPT, "d1")
    assert _reason(COND, _x(prompt=600, slo=Slo(tpot_ms=80))) == (Path.WHOLE, Reason.SHORT_PROMPT, "d1")
    assert _reason(COND, _x(prompt=2048, slo=strict)) == (Path.PD, Reason.LONG_PROMPT, "p1")


def test_cached_length_is_clamped() -> None:
    assert _reason(COND, _x(prompt=2048, decode_cached_tokens=-5)) == (Path.PD, Reason.LONG_PROMPT, "p1")
    assert _reason(COND, _x(prompt=2048, decode_cached_tokens=10**6))[1] is Reason.DECODE_CACHED


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        DeciderConfig(mode="sometimes")
    with pytest.raises(ValueError):
        DeciderConfig(prefill_busy_load=0)
    with pytest.raises(ValueError):
        DeciderConfig(prefill_kv_full=1.5)


def test_slo_headers() -> None:
    assert slo_from_headers({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "12.5"}) == Slo(250.0, 12.5)
    for bad in ("", "abc", "-1", "0", "nan", "inf"):
        assert slo_from_headers({"x-slo-ttft-ms": bad}) == Slo()
    assert slo_from_headers({}) == Slo()


def test_every_decision_is_a_metric_series_from_the_start() -> None:
    from pdgate.router.metrics import RouterMetrics

    m = RouterMetrics()
    text = m.render().decode()
    for path, reason in PATH_REASONS:
        assert f'pdgate_router_decisions_total{{path="{path.value}",reason="{reason.value}"}} 0.0' in text
    m.decision(decide(COND, _x(prompt=10)).labels)
    assert 'pdgate_router_decisions_total{path="whole",reason="short_prompt"} 1.0' in m.render().decode()


@pytest.mark.parametrize("mode", ["always", "conditional", "never"])
def test_the_early_rules_answer_as_decide_does_whatever_the_prefill_and_the_cache(mode: str) -> None:
    """The router asks `decide_early` before it picks a prefill or looks up the decode's cache: where it
    answers, no prefill's state or cached length may change `decide`'s answer; where it does not, some
    prefill's state or cached length must be what decides."""
    cfg = DeciderConfig(mode=mode, min_pd_tokens=1024, prefill_busy_load=8.0, strict_tpot_ms=50.0)
    prefills = [None, P, SideState("p2", load=9.0, kv_usage=0.95), SideState("p3", load=0.0)]
    slos = [Slo(), Slo(ttft_ms=100.0), Slo(tpot_ms=20.0), Slo(ttft_ms=100.0, tpot_ms=80.0)]
    answered = undecided = 0
    for prompt in (0, 511, 512, 1023, 1024, 4096):
        for ledger_ok in (True, False):
            for slo in slos:
                for has_prefill in (False, True):
                    early = decide_early(cfg, prompt, "d1", has_prefill=has_prefill, ledger_ok=ledger_ok, slo=slo)
                    full = {
                        decide(cfg, _x(prompt, prefill=p, decode_cached_tokens=c, ledger_ok=ledger_ok, slo=slo))
                        for p in prefills
                        if (p is not None) is has_prefill
                        for c in (0, 600, 4096)
                    }
                    if early is not None:
                        answered += 1
                        assert full == {early}, (prompt, ledger_ok, slo, has_prefill)
                    else:
                        undecided += 1
                        assert mode != "never" and (has_prefill or mode == "always")
    assert (answered or mode == "always") and (undecided or mode == "never")

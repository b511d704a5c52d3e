"""decide_request: the decider over the router's own objects (LiveInstance, RequestFacts, settings)."""

from __future__ import annotations

from pdgate.router.bodies import COMPLETIONS, RequestFacts
from pdgate.router.breaker import CircuitBreaker
from pdgate.router.decider import DeciderConfig, Path, Reason, Slo, config_from, decide_request, side
from pdgate.router.kv_index import BlockHasher, KVIndex, Stored
from pdgate.router.pairing import InstanceView
from pdgate.router.policies.cache_aware import CacheAware
from pdgate.router.pool import LiveInstance
from pdgate.router.settings import RouterSettings

from pdgate.models import Role

COND = DeciderConfig(mode="conditional", min_pd_tokens=1024)
PROMPT = list(range(2048))


def inst(name: str, role: Role, requests: int = 0, kv_usage: float = 0.0) -> LiveInstance:
    li = LiveInstance(
        InstanceView(name, role, f"http://{name}:1", "m", block_size=16, kv_usage=kv_usage), CircuitBreaker()
    )
    li.requests = requests
    return li


def facts(n: int = len(PROMPT)) -> RequestFacts:
    return RequestFacts(COMPLETIONS, "m", False, n, 16, b"", PROMPT[:n])


def test_side_reads_load_and_kv_use() -> None:
    s = side(inst("d", Role.DECODE, requests=3, kv_usage=0.5))
    assert (s.id, s.load, s.kv_usage) == ("d", 3.0, 0.5)


def test_the_decodes_cached_prefix_from_the_kv_events_decides() -> None:
    idx = KVIndex()
    idx.apply("d", 0, [Stored(tuple(BlockHasher(16).keys(PROMPT)[:100]), 16)])  # 1,600 of 2,048 tokens
    policy = CacheAware(idx)
    d, p = inst("d", Role.DECODE), inst("p", Role.PREFILL)
    got = decide_request(COND, facts(), d, p, cached_tokens=policy.cached_tokens)
    assert (got.path, got.reason, got.where) == (Path.WHOLE, Reason.DECODE_CACHED, "d")
    got = decide_request(COND, facts(), d, p)  # events off: the whole prompt counts
    assert (got.path, got.reason, got.where) == (Path.PD, Reason.LONG_PROMPT, "p")
    got = decide_request(COND, facts(), d, p, ledger_ok=False)
    assert got.reason is Reason.LEDGER_DOWN
    got = decide_request(COND, facts(600), d, p, slo=Slo(tpot_ms=20))
    assert got.reason is Reason.SLO_TPOT


def test_always_looks_nothing_up() -> None:
    def boom(_i: LiveInstance, _r: RequestFacts) -> int:
        raise AssertionError("looked up")

    d, p = inst("d", Role.DECODE), inst("p", Role.PREFILL)
    got = decide_request(DeciderConfig(), facts(10), d, p, cached_tokens=boom)
    assert (got.path, got.reason, got.where) == (Path.PD, Reason.ALWAYS, "p")
    assert decide_request(DeciderConfig(mode="never"), facts(), d, p, cached_tokens=boom).where == "d"


def test_settings_map_to_the_config() -> None:
    cfg = config_from(RouterSettings(disaggregation="conditional", pd_min_tokens=512))
    assert (cfg.mode, cfg.min_pd_tokens) == ("conditional", 512)
    assert config_from(RouterSettings()).mode == "always"
    tuned = config_from(RouterSettings(pd_prefill_busy_load=2.5, pd_prefill_kv_full=0.75))
    assert (tuned.prefill_busy_load, tuned.prefill_kv_full) == (2.5, 0.75)
    # The router's defaults are the decider's: one set of thresholds, whichever way the decider is built.
    plain, stock = config_from(RouterSettings(disaggregation="conditional")), DeciderConfig(mode="conditional")
    assert plain == stock

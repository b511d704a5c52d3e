"""The faults of the chaos suite (issue 10, scenarios 1-6 and 8; issue 24, scenario 9); the network partition
is in chaos_netns.

Each fault is a function of a `Ctx`: it injects at once, and returns when the fault is healed (a kill is
healed when it returns; a SIGSTOP or an outage when the process is back). What a scenario must show
beyond the shared zeros goes into `ctx.extra`; keys starting with `ok_` are pass/fail checks.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Any

import httpx
from chaos_run import Ctx
from chaos_stack import TOKEN, Proc, held_blocks, metric_by_label, sim_stats, wait_ready

__all__ = ["SCENARIOS"]


def kill_decode(ctx: Ctx) -> None:
    ctx.stack.decodes[0].kill()


def kill_prefill(ctx: Ctx) -> None:
    ctx.stack.prefills[0].kill()


def stop_decode(ctx: Ctx) -> None:
    """SIGSTOP a decode: its sockets stay open and silent (a hang, not a refusal), then SIGCONT."""
    d = ctx.stack.decodes[0]
    d.signal(signal.SIGSTOP)
    time.sleep(ctx.knobs.stop_s)
    d.signal(signal.SIGCONT)
    ctx.extra["stats_at_cont"] = _counts(d.url)


def after_stop_decode(ctx: Ctx) -> None:
    d = ctx.stack.decodes[0]
    before = ctx.extra.pop("stats_at_cont", {}) or {}
    after = _counts(d.url)
    ctx.extra["claimed_after_cont"] = after.get("claimed", 0) - before.get("claimed", 0)
    ctx.extra["ok_back_in_rotation"] = ctx.extra["claimed_after_cont"] > 0
    # The late decode's claims on handoffs the router gave up on are refused by the ledger (load error).
    ctx.extra["late_claims_refused"] = after.get("kv_expired", 0) + after.get("status_504", 0)
    ctx.extra["kv_mismatches"] = sum(_counts(s.url).get("mismatches", 0) for s in ctx.stack.decodes)
    ctx.extra["ok_no_wrong_kv"] = ctx.extra["kv_mismatches"] == 0


def _counts(url: str) -> dict[str, int]:
    st = sim_stats(url)
    return dict(st.get("counts", {})) if st else {}


def _outage_probe(ctx: Ctx, until: float, key: str = "probe") -> None:
    """While a dependency is down (or just back): how fast the router answers, and what its /health says."""
    router = ctx.stack.routers[0].url
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    health: dict[str, Any] | None = None
    n = 0
    while time.time() < until and n < 200:
        n += 1
        t0 = time.time()
        try:
            r = httpx.post(
                router + "/v1/completions",
                json={"model": "sim-model", "prompt": f"probe {n}", "max_tokens": 4},
                timeout=ctx.stack.timing.metaserver_timeout_s * 10,
            )
            latencies.append(time.time() - t0)
            err = r.json().get("error") if r.status_code != 200 else None
            codes[f"{r.status_code} {err.get('code') if isinstance(err, dict) else ''}".strip()] += 1
        except httpx.HTTPError as exc:
            codes[type(exc).__name__] += 1
        if health is None and key == "probe" and time.time() - ctx.t_fault > 1.0:
            try:
                h = httpx.get(router + "/health", timeout=2.0)
                health = {"status": h.status_code, "registry_error": h.json().get("registry_error")}
            except (httpx.HTTPError, ValueError) as exc:
                health = {"error": repr(exc)}
        time.sleep(0.1)
    ctx.extra[f"{key}_answers"] = dict(codes)
    ctx.extra[f"{key}_max_latency_s"] = round(max(latencies), 3) if latencies else None
    if key == "probe":
        ctx.extra["health_during_outage"] = health


def _outage_s(ctx: Ctx) -> float:
    """Down past the engines' instance lease: their records lapse (or vanish) while no heartbeat lands."""
    return max(ctx.knobs.outage_s, ctx.stack.timing.instance_lease_s + 0.5)


def _probe_after(ctx: Ctx) -> None:
    """Right after the dependency is back, for one instance lease: engines re-register meanwhile, and the
    router must keep serving them (issue 10: instances don't vanish because the registry was unreadable)."""
    _outage_probe(ctx, time.time() + ctx.stack.timing.instance_lease_s + 1.0, key="probe_after")


def _redis_restart(ctx: Ctx) -> None:
    redis = ctx.stack.redis
    assert redis is not None and redis.pid is not None
    kv_before = _kv_keys(ctx)
    # Decodes claim a little late, so that READY records (prefill blocks held) exist when Redis dies.
    for d in ctx.stack.decodes:
        httpx.post(d.url + "/sim/script", json={"decode_delay": 0.3}, timeout=3.0)
    time.sleep(1.0)
    ctx.extra["held_blocks_at_crash"] = sum(v or 0 for v in held_blocks(ctx.stack).values())
    ctx.t_fault = time.time()  # the fault is the crash, not the set-up before it
    os.kill(redis.pid, signal.SIGKILL)  # a crash: no shutdown save, no final AOF fsync
    redis.stop()
    _outage_probe(ctx, time.time() + _outage_s(ctx))
    redis.start()
    _probe_after(ctx)
    ctx.extra["kv_keys_before"] = kv_before
    for d in ctx.stack.decodes:
        httpx.post(d.url + "/sim/script", json={"decode_delay": 0.0}, timeout=3.0)


def after_redis(ctx: Ctx) -> None:
    # A prefill log is a bounded ring: keep what was read before the fault too.
    seen = {**ctx.extra.pop("kv_keys_before", {}), **_kv_keys(ctx)}
    keys = Counter(seen.values())
    ctx.extra["kv_keys_seen"] = len(keys)
    ctx.extra["kv_keys_repeated"] = sum(1 for n in keys.values() if n > 1)
    ctx.extra["ok_kv_keys_unique"] = ctx.extra["kv_keys_repeated"] == 0
    ctx.extra["prefill_frees"] = frees = {p.name: (sim_stats(p.url) or {}).get("freed") for p in ctx.stack.prefills}
    if not ctx.stack.aof:  # the ledger lost the READY records: prefills freed them without an event
        lost = sum((f or {}).get("record_lost", 0) + (f or {}).get("local_deadline", 0) for f in frees.values())
        ctx.extra["ok_lost_records_freed"] = lost > 0 or ctx.extra.get("held_blocks_at_crash") == 0
    # Requests that started while Redis was down (those in flight at the crash include their earlier work).
    errs = [r for r in ctx.records() if r.get("c") == "pd_metaserver_unavailable" and r["t0"] >= ctx.t_fault]
    ctx.extra["outage_503_max_s"] = round(max((r["t1"] - r["t0"] for r in errs), default=0.0), 3)
    lat = ctx.extra.get("probe_max_latency_s")
    bound = ctx.stack.timing.metaserver_timeout_s * 2 + 0.5
    ctx.extra["ok_fast_503"] = lat is not None and lat <= bound and _probe_typed(ctx)
    after_outage(ctx)


def after_outage(ctx: Ctx) -> None:
    """During the outage and for one lease after it, the router names the broken dependency or serves:
    never `pd_no_compatible_pair` for instances that only lapsed because they could not heartbeat."""
    answers = {**ctx.extra.get("probe_answers", {})}
    for k, n in ctx.extra.get("probe_after_answers", {}).items():
        answers[k] = answers.get(k, 0) + n
    ctx.extra["ok_outage_named"] = bool(answers) and all(
        k == "503 pd_metaserver_unavailable" or k.startswith("200") for k in answers
    )


def _probe_typed(ctx: Ctx) -> bool:
    answers = ctx.extra.get("probe_answers", {})
    return all(k.startswith("200") or "pd_" in k or k.startswith("429") for k in answers)


def _kv_keys(ctx: Ctx) -> dict[str, int]:
    """transfer id -> kv_key of every handoff a prefill saw: a repeat is one key on two transfers."""
    seen: dict[str, int] = {}
    for p in ctx.stack.prefills:
        if not p.alive:
            continue
        for e in (sim_stats(p.url, log=True) or {}).get("log", []):
            kv = (e.get("body") or {}).get("kv_transfer_params") or {}
            if e.get("mode") == "prefill" and kv.get("kv_key") and e.get("transfer_id"):
                seen[e["transfer_id"]] = int(kv["kv_key"])
    return seen


def restart_metaserver(ctx: Ctx) -> None:
    st = ctx.stack
    assert st.metaserver is not None
    st.metaserver.kill()
    _outage_probe(ctx, time.time() + _outage_s(ctx))
    st.metaserver = st.start_metaserver()
    wait_ready(st.meta_url, proc=st.metaserver)
    _probe_after(ctx)


def kill_all_prefills(ctx: Ctx) -> None:
    """SIGKILL every prefill, keep them dead for `prefills_down_s`, then start them again (same id, same
    port when it is free): with no prefill live the router must serve requests whole on the decodes."""
    st = ctx.stack
    old = list(st.prefills)
    for p in old:
        p.kill()
    t_dead = time.time()
    time.sleep(max(0.0, ctx.knobs.prefills_down_s - (t_dead - ctx.t_fault)))
    ctx.extra["prefills_down_s"] = round(time.time() - ctx.t_fault, 2)
    ctx.extra["whole_at_restart"] = _undisaggregated(st.routers[0].url)
    for i, p in enumerate(old):
        st.prefills[i] = _restart_sim(ctx, "prefill", f"p{i}", p.port)


def _restart_sim(ctx: Ctx, role: str, iid: str, port: int) -> Proc:
    """The engine back on its port, or on a fresh one when the old port cannot be bound yet."""
    new = ctx.stack.start_sim(role, iid, port=port)
    try:
        wait_ready(new.url, proc=new)
    except RuntimeError:  # exited at once: the port is still taken
        new = ctx.stack.start_sim(role, iid)
        wait_ready(new.url, proc=new)
        ctx.extra[f"{iid}_new_port"] = True
    return new


def _undisaggregated(router_url: str) -> dict[str, float] | None:
    """pdgate_router_undisaggregated_total by reason: requests the router served whole (None: no answer)."""
    return metric_by_label(router_url, "pdgate_router_undisaggregated_total", "reason")


def after_all_prefills(ctx: Ctx) -> None:
    """What served the load while no prefill lived, and that the prefills are back in rotation after."""
    recs = ctx.records()
    window = [r for r in recs if ctx.t_fault <= r["t0"] <= ctx.t_healed]
    ctx.extra["requests_started_while_down"] = len(window)
    ctx.extra["whole_answers_while_down"] = sum(1 for r in window if r["o"] == "ok" and r.get("p") == "whole")
    ctx.extra["router_undisaggregated"] = _undisaggregated(ctx.stack.routers[0].url)
    ctx.extra["decode_plain_requests"] = sum(_counts(d.url).get("plain", 0) for d in ctx.stack.decodes)
    ctx.extra["prefill_requests_after"] = sum(_counts(p.url).get("prefill", 0) for p in ctx.stack.prefills)
    ctx.extra["ok_served_whole"] = ctx.extra["whole_answers_while_down"] > 0
    ctx.extra["ok_prefills_back_in_rotation"] = ctx.extra["prefill_requests_after"] > 0


def kill_router(ctx: Ctx) -> None:
    ctx.stack.routers[1].kill()


def reregister(ctx: Ctx) -> None:
    """Register a live prefill again (identical), then bring decode d0 back on a new URL and kill the old."""
    st = ctx.stack
    auth = {"Authorization": f"Bearer {TOKEN}"}
    dup = []
    for _ in range(3):
        rec = httpx.get(f"{st.meta_url}/v1/instances/p0", headers=auth, timeout=2.0).json()
        keep = (
            "id role url model dp_rank dp_size tp_size block_size kv_dtype kv_layout kv_replicated "
            "transport engine_id lease_s"
        ).split()
        body = {k: rec[k] for k in keep if k in rec}
        dup.append(httpx.post(f"{st.meta_url}/v1/instances", json=body, headers=auth, timeout=2.0).status_code)
        time.sleep(0.3)
    ctx.extra["duplicate_register_status"] = dup
    old = st.decodes[0]
    new = st.start_sim("decode", "d0")
    wait_ready(new.url, proc=new)
    time.sleep(1.0)
    old.kill()
    st.decodes[0] = new
    rec = httpx.get(f"{st.meta_url}/v1/instances/d0", headers=auth, timeout=2.0).json()
    ctx.extra["d0_url_now"] = rec.get("url") == new.url


def after_reregister(ctx: Ctx) -> None:
    claimed = _counts(ctx.stack.decodes[0].url).get("claimed", 0)
    ctx.extra["new_d0_claimed"] = claimed
    ctx.extra["ok_new_url_in_rotation"] = claimed > 0 and bool(ctx.extra.get("d0_url_now"))


# name -> (title, fault, options for run_scenario)
SCENARIOS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "1-kill-decode": ("SIGKILL one decode", kill_decode, {}),
    "2-kill-prefill": ("SIGKILL one prefill", kill_prefill, {}),
    "3-stop-decode": ("SIGSTOP one decode, then SIGCONT", stop_decode, {"after": after_stop_decode}),
    "4a-redis-restart": ("Restart Redis (no persistence)", _redis_restart, {"after": after_redis}),
    "4b-redis-restart-aof": ("Restart Redis (AOF everysec)", _redis_restart, {"after": after_redis, "aof": True}),
    "5-metaserver-restart": ("Kill and restart the metaserver", restart_metaserver, {"after": after_outage}),
    "6-kill-router": ("Kill one of two routers (client round robin)", kill_router, {"routers": 2, "failover": True}),
    "8-reregister": ("Engine registered twice / back on a new URL", reregister, {"after": after_reregister}),
    "9-kill-all-prefills": (
        "SIGKILL every prefill for 10 s, then start them again",
        kill_all_prefills,
        {"after": after_all_prefills},
    ),
}

"""The checks of `pdgate doctor` that ask each engine itself (issue #26): is the role it registered the one
its vLLM runs with, and do its connector's tokens agree with the router's and the metaserver's.

Why the engine: the registry holds what the connector (or a hand-written registration) said; only the
engine knows what it runs with. Each check says when nothing can be observed, and what that leaves unseen.
- Role: vLLM shows its `kv_transfer_config` at `GET /server_info?config_format=json`, which exists only
  with `VLLM_SERVER_DEV_MODE=1`; its `kv_role` maps onto the registry's role by the connector's own rule
  (`pdgate.models.KV_ROLES`).
- Tokens: a PDGateConnector engine's `/metrics` carries its counters (`pdgate_connector_*`). A record in
  the registry means the metaserver took the engine's token for its registration and heartbeats; router
  claims not sealed with the engine's token (`claims_untrusted`) mean the router's ledger token is another
  one; READYs refused (`ready_failed`) are a prefill whose token (or ledger) is wrong. An engine whose token
  the metaserver refuses never registers, so from here it is only missing (its log says 401).
"""

from __future__ import annotations

from typing import Any

import httpx
from pdgate.cli.client import engine_metrics
from pdgate.cli.doctor import Facts, Finding

from pdgate.models import KV_ROLES

__all__ = ["engine_roles", "engine_tokens"]

_CONNECTOR = "pdgate_connector_"  # connector/stats.py's METRIC_PREFIX (that module imports vLLM)


def _kv_role(f: Facts, url: str) -> str | None:
    """The engine's kv_transfer_config.kv_role from vLLM's /server_info (None: not exposed)."""
    try:
        resp = f.admin.get(url.rstrip("/") + "/server_info?config_format=json")
        if resp.status_code != 200:
            return None
        kv = (resp.json().get("vllm_config") or {}).get("kv_transfer_config") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    role = kv.get("kv_role") if isinstance(kv, dict) else None
    return role if isinstance(role, str) else None


def engine_roles(f: Facts) -> list[Finding]:
    """The role each engine registered against its vLLM's kv_role (kv_producer = prefill, kv_consumer =
    decode, kv_both = both): a wrong one sends prefills to a decode, or decodes to a prefill."""
    out = []
    for url in sorted({i["url"] for i in f.registry or []}):
        kv_role = _kv_role(f, url)
        if kv_role is None:
            continue
        role = KV_ROLES.get(kv_role)
        want = None if role is None else role.value
        for inst in (i for i in f.registry or [] if i["url"] == url):
            if want == inst.get("role"):
                out.append(Finding("role", "ok", f"{inst['id']}: role {want}, as its kv_role {kv_role}"))
                continue
            out.append(
                Finding(
                    "role",
                    "fail",
                    f"{inst['id']} registered as {inst.get('role')}, but its vLLM runs with kv_role {kv_role}"
                    + (f" ({want})" if want else ""),
                    "register the role of its kv_transfer_config (let the connector register it), or start the "
                    "engine with the kv_role of its registered role",
                )
            )
    return out or [
        Finding(
            "role",
            "skip",
            "no engine shows its kv_transfer_config (vLLM's /server_info needs VLLM_SERVER_DEV_MODE=1): "
            "the registered roles are the connectors' own reading of kv_role",
        )
    ]


def _connector_counts(f: Facts, url: str) -> dict[str, float] | None:
    """The engine's connector counters, summed over its labels (None: no pdgate_connector_* on /metrics)."""
    samples = engine_metrics(f.admin, url)
    if samples is None:
        return None
    counts: dict[str, float] = {}
    for (name, _), value in samples.items():
        if name.startswith(_CONNECTOR) and name.endswith("_total"):
            key = name[len(_CONNECTOR) : -len("_total")]
            counts[key] = counts.get(key, 0.0) + value
    return counts if "registrations" in counts else None


def _token_finding(inst: dict[str, Any], counts: dict[str, float]) -> Finding:
    who = f"{inst.get('role')} {inst['id']}"
    if counts.get("claims_untrusted", 0) > 0:
        return Finding(
            "tokens",
            "fail",
            f"{who}: {counts['claims_untrusted']:.0f} router claims were not sealed with its connector token: the "
            "router's ledger token is not the engine's",
            "give the engines' PDGATE_CONNECTOR_METASERVER_TOKEN the metaserver's admin token, as the router's "
            "--metaserver-token (or --admin-token when embedded)",
        )
    if counts.get("ready_failed", 0) > 0:
        return Finding(
            "tokens",
            "warn",
            f"{who}: the ledger refused {counts['ready_failed']:.0f} READY records: a token the metaserver refuses, "
            "or a metaserver_url other than the router's",
            "check the engine's PDGATE_CONNECTOR_METASERVER_TOKEN and metaserver_url against the router's",
        )
    return Finding("tokens", "ok", f"{who}: registered under its connector token, no claim or READY refused")


def engine_tokens(f: Facts) -> list[Finding]:
    """The engines' connector token is the one the metaserver and the router use (see the module doc for
    what is observable)."""
    out: list[Finding] = []
    for url in sorted({i["url"] for i in f.registry or []}):
        counts = _connector_counts(f, url)
        if counts is not None:
            out.extend(_token_finding(inst, counts) for inst in f.registry or [] if inst["url"] == url)
    return out or [
        Finding(
            "tokens",
            "skip",
            "no engine shows pdgate_connector_* counters on /metrics (not PDGateConnector engines): an engine "
            "whose token the metaserver refuses is only missing from the registry (its log says 401)",
        )
    ]

"""The checks of `pdgate doctor`: each a small function of the `Facts` returning its findings.

Each names what is wrong in the words an operator acts on (an instance id, a URL, a setting) and how to
fix it. Order: can the pieces be reached and do they take the token; can they reach each other; does the
registry agree with the router's pool; will the engines pair and move KV; then clocks and versions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
from pdgate.cli.client import engine_metrics
from pdgate.cli.doctor import Facts, Finding
from pdgate.cli.engine_checks import engine_roles, engine_tokens

from pdgate.auth import is_loopback
from pdgate.models import CONTRACT_VERSION, TransportKind
from pdgate.pairing import KVFacts, mismatch
from pdgate.urls import InvalidEngineURL, check_engine_url, parse_networks

__all__ = ["CHECKS", "TRANSPORT_MODULES"]

# The module each transport's engine imports (what the connector loads on an engine host).
TRANSPORT_MODULES = {"nixl": "nixl._api", "mooncake": "mooncake.engine", "llmdatadist": "llm_datadist"}
MAX_SKEW_S = 0.5  # leases are seconds long; a larger skew moves their ends


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


def _loopback(host: str) -> bool:
    return host == "localhost" or (host != "" and is_loopback(host))


def services(f: Facts) -> list[Finding]:
    """The router and the metaserver answer, and take the token."""
    out = []
    if f.registry_error is not None:
        out.append(Finding("metaserver", "fail", f.registry_error, "check --metaserver and --token (pdgate config)"))
    else:
        out.append(Finding("metaserver", "ok", f"{f.admin.s.meta_url}: {len(f.registry or [])} instances registered"))
    if f.admin.s.router is None:
        out.append(Finding("router", "skip", "no router URL given", "give --router to check the router too"))
    elif f.router_error is not None:
        out.append(Finding("router", "fail", f.router_error, "check --router and --token"))
    else:
        h = f.router_health or {}
        rows = h.get("instances", [])
        if rows and "url" not in rows[0]:
            out.append(
                Finding(
                    "router",
                    "fail",
                    "the router did not take --token as its admin token (its /health hid the instances' URLs)",
                    "give the router's --admin-token as --token / PDGATE_CLI_TOKEN",
                )
            )
        reg = h.get("registry_error")
        if reg:
            out.append(
                Finding(
                    "router",
                    "fail",
                    f"the router cannot read its registry: {reg}",
                    "the router's --metaserver and --metaserver-token must be the metaserver's URL and admin token",
                )
            )
        out.append(
            Finding(
                "router",
                "ok" if h.get("status") == "ok" else "warn",
                f"{f.admin.s.router}: {h.get('status')}; {h.get('reason') or 'serving'}",
            )
        )
    return out


def _local_address_towards(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent: a UDP connect only picks the route)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _own_address(host: str) -> bool:
    """Whether `host` is an address of this host (an engine there reaches a loopback-bound service)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
            return True
    except OSError:
        return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def bind_addresses(f: Facts) -> list[Finding]:
    """A router or metaserver given at a loopback URL while engines registered from other addresses: is
    it bound to loopback only? Tried on this host's address towards those engines. Engines on this host
    (registered from one of its own addresses, as `vllm serve` without --host does) reach loopback."""
    engines = sorted({_host(i["url"]) for i in f.registry or []} - {""})
    remote = [h for h in engines if not _loopback(h) and not _own_address(h)]
    out = []
    for name, url in (("router", f.admin.s.router), ("metaserver", f.admin.s.meta_url)):
        if url is None or not _loopback(_host(url)) or not remote:
            continue
        port = urlsplit(url).port or 80
        here = _local_address_towards(remote[0])
        if here is None or _loopback(here):
            continue
        if _accepts(here, port):
            out.append(Finding("bind", "ok", f"the {name} on port {port} also answers on {here}"))
        else:
            out.append(
                Finding(
                    "bind",
                    "fail",
                    f"the {name} answers on {_host(url)}:{port} but not on {here}:{port}, while engines registered "
                    f"from {', '.join(remote[:3])}: it is bound to loopback and they cannot reach it",
                    f"start the {name} with --host 0.0.0.0 (or {here}) and give the engines its routable URL",
                )
            )
    return out or [Finding("bind", "skip", "no loopback-bound service with engines on other hosts")]


def engines_reachable(f: Facts) -> list[Finding]:
    """Every registered engine answers GET /health from this host (run doctor on the router's host)."""
    out = []
    for url in sorted({i["url"] for i in f.registry or []}):
        ids = ", ".join(i["id"] for i in f.registry or [] if i["url"] == url)
        try:
            resp = f.admin.get(url.rstrip("/") + "/health")
        except httpx.HTTPError as exc:
            out.append(
                Finding(
                    "engines",
                    "fail",
                    f"{ids} at {url} cannot be reached from this host ({type(exc).__name__})",
                    "check the engine is up and its advertised URL (the connector's url, or --host/--port) is "
                    "routable from the router's host",
                )
            )
            continue
        if resp.status_code in (401, 403):
            out.append(
                Finding(
                    "engines",
                    "fail",
                    f"{ids} at {url} refuses calls without a key ({resp.status_code})",
                    "give the router the engines' --api-key as --upstream-api-key",
                )
            )
        elif resp.status_code != 200:
            out.append(Finding("engines", "warn", f"{ids} at {url}: /health answered {resp.status_code}"))
        else:
            out.append(Finding("engines", "ok", f"{ids} at {url} answers"))
    return out or [Finding("engines", "skip", "no engine registered")]


def _cache_config(f: Facts, url: str) -> dict[str, str] | None:
    """The labels of vLLM's `vllm:cache_config_info` on the engine's /metrics (None: not a vLLM, or no
    answer): what the engine really runs with, as vLLM itself reports it."""
    samples = engine_metrics(f.admin, url)
    if samples is None:
        return None
    found = [dict(labels) for (name, labels) in samples if name == "vllm:cache_config_info"]
    return found[0] if found else None


def engine_config(f: Facts) -> list[Finding]:
    """What each engine registered (its connector's view of its kv_transfer_config and engine flags)
    against what its vLLM reports running with: block size, KV cache dtype."""
    out = []
    for url in sorted({i["url"] for i in f.registry or []}):
        cfg = _cache_config(f, url)
        if cfg is None:
            continue
        for inst in (i for i in f.registry or [] if i["url"] == url):
            wrong = []
            if cfg.get("block_size") not in (None, "None") and cfg["block_size"] != str(inst.get("block_size")):
                wrong.append(f"block_size {inst.get('block_size')} registered, {cfg['block_size']} in vLLM")
            dtype = cfg.get("cache_dtype")
            if dtype not in (None, "auto") and inst.get("kv_dtype") not in (None, dtype):
                wrong.append(f"kv_dtype {inst.get('kv_dtype')} registered, cache_dtype {dtype} in vLLM")
            if wrong:
                out.append(
                    Finding(
                        "config",
                        "fail",
                        f"{inst['id']}: " + "; ".join(wrong) + " (vllm:cache_config_info): its pairs would be wrong",
                        "register what the engine runs with: let the connector register it (kv_transfer_config), "
                        "or fix the static --block-size / the hand-written registration",
                    )
                )
            else:
                out.append(Finding("config", "ok", f"{inst['id']}: registration agrees with vLLM's cache config"))
    return out or [Finding("config", "skip", "no engine exposes vLLM's cache_config_info (not vLLM, or no /metrics)")]


def pool_vs_registry(f: Facts) -> list[Finding]:
    """The router's pool and the metaserver's registry list the same instances. An instance registered
    but not in the pool was left out by the router; one in the pool but not registered reports to
    another ledger (or none), and the router's handoffs for it stay PENDING."""
    if f.registry is None or f.router_health is None:
        return [Finding("pool", "skip", "needs both the registry and the router's admin /health")]
    rows = f.router_health.get("instances", [])
    if rows and "url" not in rows[0]:
        return [Finding("pool", "skip", "the router's admin view is needed (see the router line)")]
    pool = {r["id"] for r in rows}
    nets = parse_networks(f.allowed_engine_networks) if f.allowed_engine_networks else ()
    out = []
    for inst in f.registry:
        if inst["id"] in pool:
            continue
        why = "the router dropped its URL (outside the router's --allowed-engine-networks?)"
        if nets:
            try:
                check_engine_url(inst["url"], nets)
            except InvalidEngineURL as exc:
                why = f"its URL is outside --allowed-engine-networks ({exc})"
        out.append(
            Finding(
                "pool",
                "fail",
                f"{inst['role']} {inst['id']} ({inst['url']}) is registered but not in the router's pool: {why}",
                "add its network to the router's --allowed-engine-networks, or fix the engine's advertised URL",
            )
        )
    for r in rows:
        if r["id"] in {i["id"] for i in f.registry} and r.get("available") is False:
            out.append(
                Finding(
                    "pool",
                    "warn",
                    f"the router gives {r['role']} {r['id']} no work: {r.get('reason')} (breaker {r.get('breaker')})",
                    "a failing health check: look at the engine's log, and at its --api-key against the router's "
                    "--upstream-api-key (a 401)",
                )
            )
    registered = {i["id"] for i in f.registry}
    pending = _pending(f)
    for r in rows:
        if r["id"] not in registered:
            stuck = f"; {pending} handoffs are PENDING now" if pending else ""
            out.append(
                Finding(
                    "pool",
                    "fail",
                    f"the router routes to {r['role']} {r['id']} ({r.get('url')}), which the metaserver at "
                    f"{f.admin.s.meta_url} does not list: its connector reports to another ledger (or it is a "
                    f"static --prefill/--decode engine){stuck}",
                    "point the engine's PDGATE_CONNECTOR_METASERVER_URL (and the router's --metaserver) at the "
                    "same metaserver",
                )
            )
    return out or [Finding("pool", "ok", f"the router's pool and the registry agree ({len(pool)} instances)")]


def _pending(f: Facts) -> int:
    try:
        return f.admin.handoff_counts().get("PENDING", 0)
    except Exception:
        return 0


def _shape(inst: dict[str, Any]) -> KVFacts:
    return KVFacts(
        model=inst.get("model"),
        block_size=inst.get("block_size"),
        kv_dtype=inst.get("kv_dtype"),
        kv_layout=inst.get("kv_layout"),
        transport=TransportKind(inst["transport"]) if inst.get("transport") else None,
        tp_size=inst.get("tp_size"),
        kv_replicated=bool(inst.get("kv_replicated")),
    )


def pairing(f: Facts) -> list[Finding]:
    """Every prefill has a decode that can take its KV (the pairing rule of pdgate/pairing.py over what
    each engine's connector registered from its kv_transfer_config: model, block size, dtype, layout,
    transport, TP)."""
    regs = f.registry or []
    prefills = [i for i in regs if i["role"] in ("prefill", "both") and i.get("state") == "ready"]
    decodes = [i for i in regs if i["role"] in ("decode", "both") and i.get("state") == "ready"]
    if not prefills or not decodes:
        missing = "prefill" if not prefills else "decode"
        if not regs:
            return [Finding("pairing", "skip", "no engine registered")]
        return [Finding("pairing", "fail", f"no ready {missing} is registered", f"start (or undrain) a {missing}")]
    out = []
    for p in prefills:
        why = [(d, mismatch(_shape(p), _shape(d))) for d in decodes if d["id"] != p["id"]]
        if any(m is None for _, m in why):
            continue
        first = next(((d, m) for d, m in why if m is not None), None)
        detail = first[1].describe(p["id"], first[0]["id"]) if first and first[1] else "no other decode"
        out.append(
            Finding(
                "pairing",
                "fail",
                f"prefill {p['id']} pairs with no decode: {detail}",
                "make both sides' kv_transfer_config and engine flags agree (model, block size, kv dtype, "
                "transport, TP)",
            )
        )
    return out or [Finding("pairing", "ok", f"every prefill pairs ({len(prefills)} prefill, {len(decodes)} decode)")]


def transports(f: Facts) -> list[Finding]:
    """The transport module each registered transport needs is importable here (run on engine hosts)."""
    kinds = sorted({str(i.get("transport")) for i in f.registry or []} & set(TRANSPORT_MODULES))
    out = []
    for kind in kinds:
        module = TRANSPORT_MODULES[str(kind)]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            out.append(Finding("transport", "ok", f"{kind}: {module} is importable on this host"))
        else:
            out.append(
                Finding(
                    "transport",
                    "warn",
                    f"{kind}: {module} is not importable on this host (engines on it could not load the connector)",
                    "on engine hosts: pip install 'pdgate[vllm]' (nixl) or the transport's wheel",
                )
            )
    return out or [Finding("transport", "skip", "no engine uses a transport with a module (nixl, mooncake, ...)")]


def side_channel_ports(f: Facts) -> list[Finding]:
    """The side-channel ports (`--side-channel-ports`, NIXL's VLLM_NIXL_SIDE_CHANNEL_PORT and up) are free
    on this host: before engines start, a port in use makes an engine fail at start-up."""
    try:
        lo, _, hi = f.side_channel_ports.partition("-")
        ports = range(int(lo), int(hi or lo) + 1)
    except ValueError:
        return [Finding("ports", "warn", f"--side-channel-ports {f.side_channel_ports!r} is not LO-HI")]
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(port)
    if not busy:
        return [Finding("ports", "ok", f"side-channel ports {ports.start}-{ports.stop - 1} are free on this host")]
    return [
        Finding(
            "ports",
            "warn",
            f"side-channel ports in use on this host: {', '.join(map(str, busy))} (fine if engines run here)",
            "before starting engines: free them, or move VLLM_NIXL_SIDE_CHANNEL_PORT to a free range",
        )
    ]


def clock_skew(f: Facts) -> list[Finding]:
    """This host's clock against Redis's (TIME), when the store is Redis: leases are wall-clock times."""
    store = (f.meta_health or {}).get("store")
    if f.redis is None:
        if store == "redis":
            return [Finding("clock", "skip", "the store is redis; give --redis URL to check the clock against it")]
        return [Finding("clock", "skip", "no redis store to compare with")]
    import redis

    try:
        client = redis.Redis.from_url(f.redis, socket_timeout=f.admin.s.timeout_s)
        client.ping()  # connect (and AUTH) first: TIME's own round trip then brackets Redis's reading
        t0 = f.clock()
        sec, usec = client.time()
        t1 = f.clock()
        client.close()
    except redis.RedisError as exc:
        return [Finding("clock", "fail", f"redis at {f.redis} cannot be read: {exc}", "check --redis")]
    skew = (sec + usec / 1e6) - (t0 + t1) / 2
    if abs(skew) > MAX_SKEW_S:
        return [
            Finding(
                "clock",
                "fail",
                f"this host's clock is {skew:+.2f} s off Redis's (more than {MAX_SKEW_S} s)",
                "run NTP (chrony) on every host of the deployment",
            )
        ]
    return [Finding("clock", "ok", f"clock within {abs(skew) * 1000:.0f} ms of Redis's")]


def versions(f: Facts) -> list[Finding]:
    """The version of every component: pdgate here, the metaserver's API, each engine's contract (what its
    connector registered with) and its server's /version. A contract other than this pdgate's fails."""
    try:
        here = importlib.metadata.version("pdgate")
    except importlib.metadata.PackageNotFoundError:
        here = "unknown"
    api = "unknown"
    if f.admin.s.meta_url is not None:
        try:
            api = str(f.admin.call("metaserver", "GET", "/openapi.json").json()["info"]["version"])
        except Exception:
            api = "unknown"
    out = [Finding("versions", "ok", f"pdgate here {here} (contract {CONTRACT_VERSION}); metaserver API {api}")]
    for inst in f.registry or []:
        v = inst.get("contract_version")
        engine = _engine_version(f, inst["url"])
        if v is not None and v != CONTRACT_VERSION:
            out.append(
                Finding(
                    "versions",
                    "fail",
                    f"{inst['id']} registered with contract {v}, this pdgate speaks {CONTRACT_VERSION}",
                    "run the same pdgate version on every host (engines, router, metaserver)",
                )
            )
        else:
            out.append(Finding("versions", "ok", f"{inst['id']}: contract {v}, engine server {engine}"))
    return out


def _engine_version(f: Facts, url: str) -> str:
    try:
        resp = f.admin.get(url.rstrip("/") + "/version")
        if resp.status_code == 200:
            return str(resp.json().get("version", "unknown"))
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "unknown"


CHECKS: tuple[Callable[[Facts], list[Finding]], ...] = (
    services,
    bind_addresses,
    engines_reachable,
    engine_config,
    engine_roles,
    engine_tokens,
    pool_vs_registry,
    pairing,
    transports,
    side_channel_ports,
    clock_skew,
    versions,
)

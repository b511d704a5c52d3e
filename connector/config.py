"""The connector's one settings object, parsed once from `kv_connector_extra_config`.

Why a hand-written parser and not `get_from_extra_config` calls spread over the code: every key is read
here, once, with its type checked, so a typo (`metaserver_ulr`) or a wrong type fails at engine start with
a sentence naming the key and the allowed ones, instead of silently falling back to a default deep inside
a worker thread. Nothing here imports vLLM; `server_facts` in `connector.py` gathers what we need from
the `VllmConfig` into `ServerFacts`, and passes the process environment for the two keys that may come
from it instead (`PDGATE_METASERVER_URL`, `PDGATE_METASERVER_TOKEN`): a secret in
`--kv-transfer-config` is visible to anyone on the host who can run `ps`, an environment variable is not.

Example (a prefill instance)::

    --kv-transfer-config '{"kv_connector": "PDGateConnector", "kv_connector_module_path": "pdgate.connector",
      "kv_role": "kv_producer", "kv_connector_extra_config": {
        "metaserver_url": "http://10.0.0.2:8300", "url": "http://10.0.0.5:8100"}}'
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALLOWED_KEYS",
    "DEFAULT_HCCN_CONF",
    "ENV_METASERVER_TOKEN",
    "ENV_METASERVER_URL",
    "ConfigError",
    "ConnectorConfig",
    "ServerFacts",
    "discover_server",
    "parse_config",
    "role_for_kv_role",
]

TRANSPORTS = ("nixl", "llmdatadist")

# Environment fallbacks for keys that should stay off the command line (the key, when set, wins).
ENV_METASERVER_URL = "PDGATE_METASERVER_URL"
ENV_METASERVER_TOKEN = "PDGATE_METASERVER_TOKEN"
_ENV_FALLBACKS = {"metaserver_url": ENV_METASERVER_URL, "metaserver_token": ENV_METASERVER_TOKEN}

# Ascend hosts describe each NPU's RoCE address here (`address_<device id>=<ip>`).
DEFAULT_HCCN_CONF = "/etc/hccn.conf"

# kv_role (vLLM) -> Role value (metaserver contract).
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}

_ID_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:\-]+")


class ConfigError(ValueError):
    """`kv_connector_extra_config` is wrong; the message names the key and says what is expected."""

    code = "connector_config_invalid"


@dataclass(frozen=True)
class ServerFacts:
    """What the connector learns about its own server from vLLM and the environment (not from the user)."""

    kv_role: str
    dp_rank: int = 0
    dp_size: int = 1
    host: str | None = None  # reachable address of this host (VLLM_HOST_IP / --host)
    port: int | None = None  # the OpenAI server's --port, when discoverable
    served_model: str | None = None


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector is configured with. Field docs are in `_FIELDS` (one place)."""

    metaserver_url: str
    instance_id: str
    url: str
    model: str
    role: str  # "prefill" | "decode" | "both"
    metaserver_token: str | None = None
    transport: str = "nixl"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    rank_table: str | None = None
    server_id: str | None = None
    device_ips: Mapping[int, str] = field(default_factory=dict)
    super_device_ids: Mapping[int, int] = field(default_factory=dict)
    super_pod_id: str | None = None
    hccn_conf: str = DEFAULT_HCCN_CONF
    lease_s: float = 15.0
    heartbeat_s: float = 5.0
    pull_timeout_s: float = 30.0
    kv_lease_s: float = 30.0
    free_margin_s: float = 10.0
    ready_wait_s: float = 30.0
    claim_lease_s: float | None = None
    feed_wait_s: float = 5.0
    stats_file: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    corrupt_pulled_bytes: bool = False
    log_level: str = "info"

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


# key -> (type tag, help). The help text is what an operator reads in the error message.
_FIELDS: dict[str, tuple[str, str]] = {
    "metaserver_url": (
        "url",
        f"base URL of the metaserver, e.g. http://10.0.0.2:8300 (required; default: ${ENV_METASERVER_URL})",
    ),
    "metaserver_token": (
        "str",
        f"bearer token for the metaserver, if it requires one (default: ${ENV_METASERVER_TOKEN}, "
        "which keeps it off the command line)",
    ),
    "instance_id": ("id", "registry id of this instance (default: <role>-<host>-<port>-dp<rank>)"),
    "url": ("url", "base URL the router calls for this server (default: http://<VLLM_HOST_IP>:<--port>)"),
    "model": ("str", "model name to advertise (default: the served model name)"),
    "transport": ("transport", "KV transport: 'nixl' (default) or 'llmdatadist'"),
    "transport_options": ("dict", "extra keyword arguments for the transport, e.g. {'ucx_net_devices': 'lo'}"),
    "rank_table": ("str", "path of the global rank table (llmdatadist; optional, wins over device discovery)"),
    "server_id": ("str", "server id to advertise (host identity in a rank table)"),
    "device_ips": (
        "ip_table",
        "llmdatadist without a rank table: IPv4 of each NPU of this host, a list indexed by device id or an "
        "object {device id: ip} (default: $PDGATE_DEVICE_IP, then hccn_conf)",
    ),
    "super_device_ids": ("int_table", "Atlas A3: super device id of each NPU, a list or object like device_ips"),
    "super_pod_id": ("str", "Atlas A3: the super pod of this host"),
    "hccn_conf": ("str", f"file with the NPUs' address_<device id>=<ip> lines (default {DEFAULT_HCCN_CONF})"),
    "lease_s": ("pos", "registry lease of this instance in seconds (default 15)"),
    "heartbeat_s": ("pos", "heartbeat interval in seconds (default 5, must be below lease_s)"),
    "pull_timeout_s": ("pos", "deadline of one KV pull in seconds (default 30)"),
    "kv_lease_s": ("pos", "handoff lease assumed when the ledger did not say (default 30)"),
    "free_margin_s": ("nonneg", "extra seconds before blocks are freed locally when the metaserver is away"),
    "ready_wait_s": ("pos", "how long a decode waits for a PENDING handoff to become READY (default 30)"),
    "claim_lease_s": ("pos", "claim lease asked for by a decode (default: the metaserver's)"),
    "feed_wait_s": ("pos", "long-poll wait of the prefill's handoff-event feed (default 5)"),
    "stats_file": ("str", "JSON file the connector keeps its counters in (for tests and operators)"),
    "labels": ("labels", "free-form string labels for the registry record"),
    "corrupt_pulled_bytes": ("bool", "TEST ONLY: XOR the pulled KV bytes on decode (negative control)"),
    "log_level": ("level", "level of the connector's own log lines: debug, info (default), warning, error"),
}

ALLOWED_KEYS: tuple[str, ...] = tuple(sorted(_FIELDS))


def role_for_kv_role(kv_role: str | None) -> str:
    """Map vLLM's kv_role onto the registry role; anything else is a configuration error."""
    if kv_role not in _ROLES:
        raise ConfigError(f"kv_role must be one of {sorted(_ROLES)} for PDGateConnector, got {kv_role!r}")
    return _ROLES[kv_role]


def parse_config(
    extra: Mapping[str, Any] | None, facts: ServerFacts, env: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """Validate `kv_connector_extra_config` and fill the defaults that depend on the server.

    `env` (the process environment; none by default, so tests stay hermetic) supplies `metaserver_url`
    and `metaserver_token` when the extra config does not set them.
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _FIELDS)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for PDGateConnector; "
            f"allowed keys: {', '.join(ALLOWED_KEYS)}"
        )
    values = {key: _check(key, value) for key, value in extra.items()}
    for key, var in _ENV_FALLBACKS.items():
        raw = (env or {}).get(var, "").strip()
        if key not in values and raw:
            values[key] = _check(key, raw, where=f"environment variable {var}")
    role = role_for_kv_role(facts.kv_role)

    if "metaserver_url" not in values:
        raise ConfigError(
            f"kv_connector_extra_config.metaserver_url is required (or the environment variable "
            f"{ENV_METASERVER_URL}): " + _FIELDS["metaserver_url"][1]
        )

    url = values.pop("url", None)
    if url is None:
        if facts.host is None or facts.port is None:
            raise ConfigError(
                "kv_connector_extra_config.url is required here: the server's address could not be discovered "
                f"(host={facts.host!r}, port={facts.port!r}); set it to the URL the router should call"
            )
        url = f"http://{_url_host(facts.host)}:{facts.port}"

    instance_id = values.pop("instance_id", None)
    if instance_id is None:
        instance_id = default_instance_id(role, url, facts.dp_rank)
    elif facts.dp_size > 1 and not instance_id.endswith(f"-dp{facts.dp_rank}"):
        # One registry record per data-parallel rank: the engine cores of one server must not share an id.
        instance_id = f"{instance_id}-dp{facts.dp_rank}"

    model = values.pop("model", None) or facts.served_model
    if not model:
        raise ConfigError("kv_connector_extra_config.model is required: no served model name is known")

    cfg = ConnectorConfig(url=url, instance_id=instance_id, model=model, role=role, **values)
    if cfg.heartbeat_s >= cfg.lease_s:
        raise ConfigError(
            f"kv_connector_extra_config.heartbeat_s ({cfg.heartbeat_s}) must be below lease_s ({cfg.lease_s}), "
            "or the registration lapses between heartbeats"
        )
    if cfg.feed_wait_s >= cfg.kv_lease_s + cfg.free_margin_s:
        raise ConfigError("kv_connector_extra_config.feed_wait_s must be below kv_lease_s + free_margin_s")
    return cfg


def default_instance_id(role: str, url: str, dp_rank: int) -> str:
    """`<role>-<host>-<port>-dp<rank>` made URL-safe; stable across restarts of the same server."""
    hostport = url.split("://", 1)[-1].rstrip("/")
    raw = f"{role}-{hostport.replace(':', '-')}-dp{dp_rank}"
    return _ID_BAD_CHARS.sub("-", raw).strip("-.:")[:128]


def discover_server(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Best-effort (host, port) of the OpenAI server this engine belongs to.

    vLLM does not hand the API server's port to the engine. The engine-core process is started with
    `multiprocessing` spawn, which copies the parent's `sys.argv`, so `--port` of `vllm serve` is visible
    here. When it is not (another launcher), the `url` key is required. The host is `VLLM_HOST_IP`
    (what vLLM itself advertises) or a non-wildcard `--host`.
    """
    port: int | None = None
    host: str | None = env.get("VLLM_HOST_IP") or None
    flag_host: str | None = None
    args = list(argv)
    for i, arg in enumerate(args):
        value: str | None = None
        name = arg
        if "=" in arg and arg.startswith("--"):
            name, value = arg.split("=", 1)
        elif i + 1 < len(args):
            value = args[i + 1]
        if name == "--port" and value is not None and value.isdigit():
            port = int(value)
        elif name == "--host" and value:
            flag_host = value
    if port is None and len(args) > 1 and "serve" in args[1:3]:
        port = 8000  # `vllm serve` default
    if host is None and flag_host not in (None, "", "0.0.0.0", "::"):
        host = flag_host
    return host, port


def _device_table(value: Any, *, ip: bool, bad: Callable[[str], ConfigError]) -> dict[int, Any]:
    """A per-device table: a list indexed by device id (null for a gap) or an object {"<id>": value}."""
    expected = (
        "a list of IPv4 addresses indexed by device id, or an object {device id: IPv4}"
        if ip
        else "a list of non-negative integers indexed by device id, or an object {device id: integer}"
    )
    if isinstance(value, list):
        items: list[tuple[Any, Any]] = [(i, v) for i, v in enumerate(value) if v is not None]
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise bad(expected)
    out: dict[int, Any] = {}
    for k, v in items:
        if isinstance(k, str) and k.isascii() and k.isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise bad(expected)
        if ip:
            try:
                if not isinstance(v, str):
                    raise ValueError(v)
                out[k] = str(ipaddress.IPv4Address(v))
            except ValueError:
                raise bad(expected) from None
        else:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(expected)
            out[k] = v
    return out


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _check(key: str, value: Any, *, where: str | None = None) -> Any:
    kind, help_text = _FIELDS[key]
    where = where or f"kv_connector_extra_config.{key}"

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where} must be {expected}, got {value!r} ({help_text})")

    if kind == "str":
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if kind == "url":
        if not isinstance(value, str) or not value.startswith(("http://", "https://")):
            raise bad("an http:// or https:// URL")
        return value.rstrip("/")
    if kind == "id":
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}", value):
            raise bad("a URL-safe id (letters, digits, . _ : -; at most 128 characters)")
        return value
    if kind == "transport":
        if value not in TRANSPORTS:
            raise bad(f"one of {list(TRANSPORTS)}")
        return value
    if kind in ("pos", "nonneg"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        if value < 0 or (kind == "pos" and value == 0):
            raise bad("a positive number" if kind == "pos" else "a number >= 0")
        return float(value)
    if kind == "level":
        if value not in ("debug", "info", "warning", "error"):
            raise bad("one of debug, info, warning, error")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "dict":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise bad("an object with string keys")
        return dict(value)
    if kind in ("ip_table", "int_table"):
        return _device_table(value, ip=kind == "ip_table", bad=bad)
    if kind == "labels":
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise bad("an object of string -> string")
        return dict(value)
    raise AssertionError(f"unhandled field kind {kind}")  # pragma: no cover

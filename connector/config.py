"""The connector's one settings object, parsed once from `kv_connector_extra_config`.

Why a hand-written parser and not `get_from_extra_config` calls spread over the code: every key is read
here, once, with its type checked, so a typo (`metaserver_ulr`) or a wrong type fails at engine start with
a sentence naming the key and the allowed ones, instead of silently falling back to a default deep inside
a worker thread. Each key is declared once, as a field of `ConnectorConfig` carrying its `Setting` (which
check applies, what it means, its default): the parser reads the checks from there, and README.md's table
is rendered from there (`python -m pdgate.connector.config` prints it; a test keeps the two equal). The
checks are hand-written rather than pydantic's so that every message names the key as the operator wrote
it, `kv_connector_extra_config.<key>`, with the sentence the README shows.

Nothing here imports vLLM; `server_facts` in `connector.py` gathers what we need from
the `VllmConfig` into `ServerFacts`, and passes the process environment for the two keys that may come
from it instead (`PDGATE_CONNECTOR_METASERVER_URL`, `PDGATE_CONNECTOR_METASERVER_TOKEN`): a secret in
`--kv-transfer-config` is visible to anyone on the host who can run `ps`, an environment variable is not.
They are named for the connector: the naming rule of pdgate's commands (`PDGATE_<COMMAND>_<FLAG>`) gives
`PDGATE_METASERVER_*` to the metaserver's own flags. The older names, `PDGATE_METASERVER_URL` and
`PDGATE_METASERVER_TOKEN`, are still read as aliases; the new name wins when both are set.

Example (a prefill instance)::

    --kv-transfer-config '{"kv_connector": "PDGateConnector", "kv_connector_module_path": "pdgate.connector",
      "kv_role": "kv_producer", "kv_connector_extra_config": {
        "metaserver_url": "http://10.0.0.2:8300", "url": "http://10.0.0.5:8100"}}'
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from pdgate.connector.errors import ConfigError
from pdgate.connector.transport.mooncake import PROTOCOLS as MOONCAKE_PROTOCOLS

from pdgate.models import KV_ROLES

__all__ = [
    "ALLOWED_KEYS",
    "DEFAULT_HCCN_CONF",
    "ENV_METASERVER_TOKEN",
    "ENV_METASERVER_URL",
    "ConnectorConfig",
    "ServerFacts",
    "Setting",
    "discover_server",
    "parse_config",
    "role_for_kv_role",
    "settings_table",
]

TRANSPORTS = ("nixl", "mooncake", "llmdatadist")

# Environment fallbacks for keys that should stay off the command line (the key, when set, wins).
ENV_METASERVER_URL = "PDGATE_CONNECTOR_METASERVER_URL"
ENV_METASERVER_TOKEN = "PDGATE_CONNECTOR_METASERVER_TOKEN"
# key -> the variables read for it, in order: the first one set wins (the older names are aliases).
_ENV_FALLBACKS = {
    "metaserver_url": (ENV_METASERVER_URL, "PDGATE_METASERVER_URL"),
    "metaserver_token": (ENV_METASERVER_TOKEN, "PDGATE_METASERVER_TOKEN"),
}

# Ascend hosts describe each NPU's RoCE address here (`address_<device id>=<ip>`).
DEFAULT_HCCN_CONF = "/etc/hccn.conf"

# kv_role (vLLM) -> Role value (metaserver contract).
_ROLES = {kv: role.value for kv, role in KV_ROLES.items()}

_ID_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:\-]+")


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
class Setting:
    """How one `kv_connector_extra_config` key is checked and documented.

    `kind` picks the check in `_check`; `doc` is the README's "Meaning" and the hint in the error message
    for a wrong value; `shown` is the README's "Default" when the default is not a plain value.
    """

    kind: str
    doc: str
    shown: str | None = None


def _key(kind: str, doc: str, *, default: Any = MISSING, shown: str | None = None, factory: Any = MISSING) -> Any:
    return field(default=default, default_factory=factory, metadata={"setting": Setting(kind, doc, shown)})


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """Everything the connector is configured with: the one declaration of every key, its check, its
    default and its documentation (`settings_table` renders README.md's table from it)."""

    metaserver_url: str = _key(
        "url",
        "Base URL of the metaserver, e.g. http://10.0.0.2:8300. Required, from one of the two.",
        shown=f"`${ENV_METASERVER_URL}`",
    )
    metaserver_token: str | None = _key(
        "str",
        "Bearer token for the metaserver's write routes. The key wins over the variable, which keeps the "
        "token off the command line.",
        default=None,
        shown=f"`${ENV_METASERVER_TOKEN}`",
    )
    url: str = _key(
        "url",
        "The URL the router calls for this server. Required when it cannot be discovered.",
        shown="`http://<VLLM_HOST_IP or --host>:<--port>`",
    )
    instance_id: str = _key(
        "id",
        "Registry id. `-dp<rank>` is appended when `dp_size > 1`.",
        shown="`<role>-<host>-<port>-dp<rank>`",
    )
    model: str = _key("str", "The model name to advertise.", shown="the served model name")
    transport: str = _key("transport", "`nixl`, `mooncake` or `llmdatadist`.", default="nixl")
    transport_options: Mapping[str, Any] = _key(
        "dict", "Keyword arguments for the transport (see `transport/README.md`).", factory=dict
    )
    mooncake_protocol: str | None = _key(
        "mooncake_protocol",
        "mooncake: `tcp`, `rdma` or `ascend`; P and D must agree. Unset: the installed wheel's (`-non-cuda` tcp, "
        "`-npu` ascend, CUDA builds rdma).",
        default=None,
        shown="the installed wheel's",
    )
    rank_table: str | None = _key(
        "str",
        "llmdatadist: the global rank table. Optional. If given it wins (and is checked against the KV "
        "cache's device).",
        default=None,
    )
    server_id: str | None = _key(
        "str",
        "This host's id in the rank table (needed with `rank_table`). It is also advertised in the registry.",
        default=None,
    )
    device_ips: Mapping[int, str] = _key(
        "ip_table",
        'llmdatadist without a rank table: the IPv4 of each NPU, as a list indexed by device id or `{"<id>": ip}`.',
        factory=dict,
        shown="`$PDGATE_DEVICE_IP`, then `hccn_conf`",
    )
    super_device_ids: Mapping[int, int] = _key(
        "int_table",
        "Atlas A3: the super device id of each NPU, as a list or object like `device_ips`.",
        factory=dict,
        shown="none",
    )
    super_pod_id: str | None = _key("str", "Atlas A3: the super pod of this host.", default=None)
    hccn_conf: str = _key("str", "The file with the `address_<device id>=<ip>` lines.", default=DEFAULT_HCCN_CONF)
    lease_s: float = _key("pos", "The registry lease of this instance, in seconds.", default=15.0)
    heartbeat_s: float = _key("pos", "The heartbeat interval. Must be below `lease_s`.", default=5.0)
    pull_timeout_s: float = _key(
        "pos", "The deadline of one KV pull (NIXL). It is also part of D's overall load deadline.", default=30.0
    )
    kv_lease_s: float = _key("pos", "The handoff lease assumed when the ledger did not say.", default=30.0)
    free_margin_s: float = _key(
        "nonneg", "Extra seconds before P frees held blocks locally while the metaserver is unreachable.", default=10.0
    )
    ready_wait_s: float = _key("pos", "How long D waits for a PENDING handoff to become READY.", default=30.0)
    claim_lease_s: float | None = _key("pos", "The claim lease D asks for.", default=None, shown="the metaserver's")
    feed_wait_s: float = _key(
        "pos", "The long-poll wait of P's handoff-event feed. Must be below `kv_lease_s + free_margin_s`.", default=5.0
    )
    stats_file: str | None = _key(
        "str", "A JSON file with the counters, rewritten atomically (at most every 0.2 s).", default=None
    )
    labels: Mapping[str, str] = _key("labels", "Free-form string labels for the registry record.", factory=dict)
    corrupt_pulled_bytes: bool = _key(
        "bool", "TEST ONLY: XOR the pulled bytes on D (negative control). CPU KV caches only.", default=False
    )
    sync_load_when_idle: bool = _key(
        "bool",
        "D with no other request loads a KV under the router's claim synchronously: the pull runs in the step "
        "that computes the request's first token, one engine step earlier.",
        default=True,
    )
    sync_pull_timeout_s: float = _key(
        "pos",
        "The deadline of a synchronous pull (`sync_load_when_idle`): the longest a stalled prefill can hold the "
        "idle decode's step; past it the pull fails, and vLLM fails the request (its kv_load_failure_policy).",
        default=5.0,
    )
    layerwise_min_tokens: float | None = _key(
        "nonneg",
        "A synchronous load of at least this many tokens is pulled layer by layer, each layer's read behind the "
        "compute of the layers before it (NIXL, Mooncake); unset: every load is pulled whole. See docs/TRANSFER.md.",
        default=None,
        shown="unset",
    )
    test_fail_layer: float | None = _key(
        "nonneg",
        "TEST ONLY: in a layer-wise load, the read of this layer (index, from 0) fails, to test that failure.",
        default=None,
        shown="unset",
    )
    control_process: bool = _key(
        "bool",
        "Run the ledger I/O in a child process instead of a thread of the engine's (off its GIL). Experimental.",
        default=False,
    )
    log_level: str = _key(
        "level", "The level of the connector's own logs: debug, info, warning, error.", default="info"
    )
    role: str  # "prefill" | "decode" | "both", from vLLM's kv_role (not a key)

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


_SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(ConnectorConfig) if f.metadata}

ALLOWED_KEYS: tuple[str, ...] = tuple(sorted(_SETTINGS))


def settings_table() -> str:
    """README.md's table of `kv_connector_extra_config` keys, rendered from `ConnectorConfig`."""
    rows = ["| Key | Default | Meaning |", "|---|---|---|"]
    for f in fields(ConnectorConfig):
        if not f.metadata:
            continue
        setting: Setting = f.metadata["setting"]
        rows.append(f"| `{f.name}` | {setting.shown or _shown_default(f)} | {setting.doc} |")
    return "\n".join(rows) + "\n"


def _shown_default(f: Field[Any]) -> str:
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


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
    and `metaserver_token` when the extra config does not set them (`ENV_METASERVER_URL`,
    `ENV_METASERVER_TOKEN`, else their older names).
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _SETTINGS)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for PDGateConnector; "
            f"allowed keys: {', '.join(ALLOWED_KEYS)}"
        )
    values = {key: _check(key, value) for key, value in extra.items()}
    for key, names in _ENV_FALLBACKS.items():
        for var in names:
            raw = (env or {}).get(var, "").strip()
            if key not in values and raw:
                values[key] = _check(key, raw, where=f"environment variable {var}")
    role = role_for_kv_role(facts.kv_role)

    if "metaserver_url" not in values:
        raise ConfigError(
            f"kv_connector_extra_config.metaserver_url is required (or the environment variable "
            f"{ENV_METASERVER_URL}): " + _SETTINGS["metaserver_url"].doc
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
    setting = _SETTINGS[key]
    kind, help_text = setting.kind, setting.doc
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
    if kind == "mooncake_protocol":
        if value not in MOONCAKE_PROTOCOLS:
            raise bad(f"one of {list(MOONCAKE_PROTOCOLS)}")
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


if __name__ == "__main__":  # regenerate README.md's table: python -m pdgate.connector.config
    print(settings_table(), end="")

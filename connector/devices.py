"""Where a worker's NPU is, for the llm_datadist transport: device ids, device IP, cluster id, A3 ids.

Two ways to know it. With a global rank table (`pdgate.connector.ranktable`) the table says, and it wins;
`from_placement` only checks that the table's device is the one this worker's KV cache is on. Without
one, each worker finds its own device here (`discover`) and publishes it in its registry record (a
`TransportAddress` per TP rank); a decode then links to the prefill's cluster with the address that
travels in the handoff's `location.transport_addresses`. Nobody needs the whole table.

What a worker finds, first source that answers wins:

  visible device id   the device index of its KV cache tensors (`npu:N`): the id `LLMConfig.device_id`
                      wants, as this process sees it. Host-memory KV caches (tests): the TP rank.
  device id           the host-level number (npu-smi, hccn_tool, rank tables): entry N of
                      `ASCEND_RT_VISIBLE_DEVICES` when that remaps devices, else N.
  device IP           `device_ips[device id]` (kv_connector_extra_config); `$PDGATE_DEVICE_IP` (one IP, or
                      `ID=IP,ID=IP,...`); the `address_<device id>=` line of `/etc/hccn.conf`.
  cluster id          the device IP read as an IPv4 integer (below).
  super_device_id     `super_device_ids[device id]` (Atlas A3; optional); super_pod_id likewise.

Why the device IP is the cluster id: llm_datadist wants a cluster id that no other linking instance
uses. Device IPs already are unique across the cluster (the RoCE fabric routes on them, and a rank table
refuses duplicates), they are known locally, and they are the same after a restart. Allocating ids from
the metaserver (an `INCR`, as the ledger does for kv keys) would be unique too, but would make the
transport's start-up wait for the metaserver, which the connector otherwise never does (registration
retries in the background). An IPv4 integer is below 2**32, inside llm_datadist's uint64; any usable
address is at least 1.0.0.0 = 2**24, so it cannot collide with a rank table's running index (0..N-1)
in a deployment where some instances still use a rank table.

Everything here is pure: the environment and the hccn.conf text are arguments; `pdgate.connector.worker`
reads them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.errors import DeviceNotFound

if TYPE_CHECKING:
    from pdgate.connector.ranktable import DevicePlacement

__all__ = [
    "ENV_DEVICE_IP",
    "ENV_VISIBLE_DEVICES",
    "DeviceIdentity",
    "cluster_id_for_ip",
    "discover",
    "from_placement",
    "parse_device_ip_env",
    "parse_hccn_conf",
    "physical_device_id",
]

ENV_DEVICE_IP = "PDGATE_DEVICE_IP"
ENV_VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"

_HCCN_ADDRESS = re.compile(r"^\s*address_(\d+)\s*=\s*(\S*)\s*$")


@dataclass(frozen=True)
class DeviceIdentity:
    """One worker's NPU, as the llm_datadist transport and its registry record describe it."""

    visible_device_id: int  # LLMConfig.device_id: the device as this process sees it
    device_id: int  # host-level id (npu-smi, hccn.conf, rank table)
    device_ip: str
    cluster_id: int
    super_device_id: int | None = None
    super_pod_id: str | None = None
    source: str = ""  # where the device IP came from, for the start-up log line


def cluster_id_for_ip(device_ip: str) -> int:
    """The device IP as an unsigned 32-bit integer (`10.0.0.1` -> 167772161); see the module docstring."""
    return int(ipaddress.IPv4Address(device_ip))


def parse_hccn_conf(text: str) -> dict[int, str]:
    """`address_<device id>=<ipv4>` lines of an hccn.conf, by device id; other lines are ignored.

    The file is machine-written (`hccn_tool -i N -ip -s address ...`), so an address that is not IPv4,
    or a device listed twice, is a fault worth stopping for: the error names the line.
    """
    out: dict[int, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _HCCN_ADDRESS.match(line)
        if m is None:
            continue
        dev, ip = int(m.group(1)), m.group(2)
        try:
            ip = str(ipaddress.IPv4Address(ip))
        except ValueError:
            raise ValueError(f"line {lineno}: address_{dev} is not an IPv4 address ({ip!r})") from None
        if dev in out:
            raise ValueError(f"line {lineno}: address_{dev} is given twice ({out[dev]} and {ip})")
        out[dev] = ip
    return out


def parse_device_ip_env(value: str) -> str | dict[int, str]:
    """`PDGATE_DEVICE_IP`: one IPv4 (this engine's only device) or `ID=IP[,ID=IP...]` by device id."""
    value = value.strip()
    if "=" not in value:
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise ValueError(f"{value!r} is neither an IPv4 address nor ID=IP[,ID=IP...]") from None
    out: dict[int, str] = {}
    for item in value.split(","):
        dev, _, ip = item.strip().partition("=")
        try:
            if not dev.isascii() or not dev.isdigit():
                raise ValueError(dev)
            out[int(dev)] = str(ipaddress.IPv4Address(ip))
        except ValueError:
            raise ValueError(f"bad entry {item!r} in {value!r}; expected ID=IP[,ID=IP...]") from None
    return out


def physical_device_id(visible: int, visible_devices: str | None) -> int:
    """Host-level id of the device this process calls `visible` (`ASCEND_RT_VISIBLE_DEVICES` remaps)."""
    if not visible_devices or not visible_devices.strip():
        return visible
    ids = [item.strip() for item in visible_devices.split(",")]
    if not all(i.isascii() and i.isdigit() for i in ids):
        raise DeviceNotFound(f"{ENV_VISIBLE_DEVICES}={visible_devices!r} is not a comma-separated list of device ids")
    if visible >= len(ids):
        raise DeviceNotFound(
            f"this worker uses device {visible}, but {ENV_VISIBLE_DEVICES}={visible_devices!r} makes only "
            f"{len(ids)} device(s) visible"
        )
    return int(ids[visible])


def discover(
    cfg: ConnectorConfig,
    *,
    visible_device_id: int,
    tp_size: int,
    env: Mapping[str, str],
    hccn_text: str | None,
) -> DeviceIdentity:
    """This worker's NPU without a rank table (see the module docstring for the order of sources).

    `hccn_text` is the content of `cfg.hccn_conf`, or None when it could not be read; it is parsed only
    when neither the config nor the environment names the device IP.
    """
    device_id = physical_device_id(visible_device_id, env.get(ENV_VISIBLE_DEVICES))
    ip, source = _device_ip(cfg, device_id, tp_size=tp_size, env=env, hccn_text=hccn_text)
    return DeviceIdentity(
        visible_device_id=visible_device_id,
        device_id=device_id,
        device_ip=ip,
        cluster_id=cluster_id_for_ip(ip),
        super_device_id=cfg.super_device_ids.get(device_id),
        super_pod_id=cfg.super_pod_id,
        source=source,
    )


def from_placement(place: DevicePlacement, *, visible_device_id: int | None, env: Mapping[str, str]) -> DeviceIdentity:
    """The rank table's answer, checked against the device the KV cache is really on (when known).

    A table that puts this worker on another device than its KV cache would make the prefill listen on,
    and the decode link from, the wrong device's IP; it fails here instead of at the first pull.
    """
    if visible_device_id is None:
        visible = place.device_id  # host-memory KV cache: nothing to check against
    else:
        visible = visible_device_id
        actual = physical_device_id(visible_device_id, env.get(ENV_VISIBLE_DEVICES))
        if actual != place.device_id:
            raise DeviceNotFound(
                f"the rank table puts {place.role.value} dp {place.dp_rank} tp {place.tp_rank} of server "
                f"{place.server_id!r} on device {place.device_id}, but its KV cache is on device {actual} "
                f"(npu:{visible_device_id}, {ENV_VISIBLE_DEVICES}={env.get(ENV_VISIBLE_DEVICES)!r}); fix the "
                "table or the engine's devices"
            )
    return DeviceIdentity(
        visible_device_id=visible,
        device_id=place.device_id,
        device_ip=place.device_ip,
        cluster_id=place.cluster_id,
        super_device_id=place.super_device_id,
        super_pod_id=place.super_pod_id,
        source="rank table",
    )


def _device_ip(
    cfg: ConnectorConfig, device_id: int, *, tp_size: int, env: Mapping[str, str], hccn_text: str | None
) -> tuple[str, str]:
    tried: list[str] = []
    if cfg.device_ips:
        if device_id in cfg.device_ips:
            return cfg.device_ips[device_id], f"kv_connector_extra_config.device_ips[{device_id}]"
        tried.append(f"kv_connector_extra_config.device_ips has devices {sorted(cfg.device_ips)}")
    raw = env.get(ENV_DEVICE_IP, "").strip()
    if raw:
        try:
            parsed = parse_device_ip_env(raw)
        except ValueError as exc:
            raise DeviceNotFound(f"{ENV_DEVICE_IP}: {exc}") from None
        if isinstance(parsed, str):
            if tp_size > 1:
                raise DeviceNotFound(
                    f"{ENV_DEVICE_IP}={raw!r} is one address for {tp_size} TP ranks, which would share one "
                    "llm_datadist cluster id; give one per device as ID=IP,ID=IP,..."
                )
            return parsed, ENV_DEVICE_IP
        if device_id in parsed:
            return parsed[device_id], f"{ENV_DEVICE_IP}[{device_id}]"
        tried.append(f"{ENV_DEVICE_IP} has devices {sorted(parsed)}")
    if hccn_text is not None:
        try:
            addresses = parse_hccn_conf(hccn_text)
        except ValueError as exc:
            raise DeviceNotFound(f"{cfg.hccn_conf}: {exc}") from None
        if device_id in addresses:
            return addresses[device_id], f"{cfg.hccn_conf} address_{device_id}"
        tried.append(f"{cfg.hccn_conf} has no address_{device_id} line")
    else:
        tried.append(f"{cfg.hccn_conf} is absent or unreadable")
    raise DeviceNotFound(
        f"the IP of NPU {device_id} is unknown ({'; '.join(tried)}). The llm_datadist transport needs it: set "
        f"kv_connector_extra_config.device_ips, or ${ENV_DEVICE_IP}, or provide {cfg.hccn_conf} "
        "(hccn_tool -i N -ip -g prints it), or give a rank_table and server_id"
    )

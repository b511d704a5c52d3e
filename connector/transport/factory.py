"""Build the transport a worker's config names: the one place that turns `ConnectorConfig` into a
transport's constructor arguments.

Runs on the worker's transfer thread (`pdgate.connector.worker`), which then owns the transport. This is the
I/O edge of device placement for llm_datadist: it reads the rank table, `/etc/hccn.conf` and the
environment, and leaves the decisions to the pure `pdgate.connector.devices` and `pdgate.connector.ranktable`
(`ranktable_parse` reads the file).
Engines are imported lazily, by `transport_class`, only for the kind configured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.devices import DeviceIdentity
from pdgate.connector.errors import ConfigError
from pdgate.connector.transport import transport_class
from pdgate.connector.transport.base import Transport

__all__ = ["llmdatadist_device", "make_transport"]

logger = logging.getLogger(__name__)


def make_transport(
    cfg: ConnectorConfig,
    *,
    tp_rank: int,
    dp_rank: int,
    tp_size: int,
    device_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Transport:
    """The transport `cfg.transport` names, built on the transfer thread.

    `device_index` is the accelerator the KV cache is on (`kv_device_index`); `env` defaults to the
    process environment. For llm_datadist the worker's device comes from the rank table when one is
    configured, else from `pdgate.connector.devices.discover` (config, `$PDGATE_DEVICE_IP`, hccn.conf).
    """
    options = dict(cfg.transport_options)
    try:
        # The one kind -> class map, imported lazily; each class takes its own keyword arguments.
        cls: Callable[..., Transport] = transport_class(cfg.transport)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.transport == "nixl":
        options.setdefault("agent_name", f"{cfg.instance_id}-tp{tp_rank}-{os.getpid()}")
        return cls(pull_timeout_s=cfg.pull_timeout_s, **options)
    if cfg.transport == "mooncake":
        # The session peers reach us at: this server's own host (the one the router calls).
        options.setdefault("hostname", urlsplit(cfg.url).hostname or "127.0.0.1")
        if cfg.mooncake_protocol:
            options.setdefault("protocol", cfg.mooncake_protocol)
        # A read cannot be cancelled: the engine's stall deadline is what bounds a synchronous load's wait
        # on a stalled prefill (`sync_pull_timeout_s`). It counts time without progress, not a pull's length.
        options.setdefault("progress_timeout_s", min(cfg.sync_pull_timeout_s, cfg.pull_timeout_s))
        return cls(pull_timeout_s=cfg.pull_timeout_s, **options)
    # llmdatadist: `transport_class` knows no other kind.
    if cfg.role not in ("prefill", "decode"):
        raise ConfigError("the llmdatadist transport needs kv_role kv_producer or kv_consumer, not kv_both")
    ident = llmdatadist_device(
        cfg, tp_rank=tp_rank, dp_rank=dp_rank, tp_size=tp_size, device_index=device_index, env=env
    )
    logger.info(
        "tp rank %d: NPU %d (visible as %d) at %s (from %s), llm_datadist cluster %d",
        tp_rank,
        ident.device_id,
        ident.visible_device_id,
        ident.device_ip,
        ident.source,
        ident.cluster_id,
    )
    return cls(
        role=cfg.role,
        cluster_id=ident.cluster_id,
        device_id=ident.device_id,
        visible_device_id=ident.visible_device_id,
        device_ip=ident.device_ip,
        server_id=cfg.server_id,
        super_device_id=ident.super_device_id,
        super_pod_id=ident.super_pod_id,
        **options,
    )


def llmdatadist_device(
    cfg: ConnectorConfig,
    *,
    tp_rank: int,
    dp_rank: int,
    tp_size: int,
    device_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DeviceIdentity:
    """This worker's NPU: the rank table's entry (checked) when configured, else discovered.

    The I/O edge of `pdgate.connector.devices`: reads the rank table and hccn.conf files and the environment.
    """
    from pdgate.connector.devices import discover, from_placement

    env = os.environ if env is None else env
    if cfg.rank_table:
        from pdgate.connector.ranktable import GroupRole, assign_ranks, find_placement
        from pdgate.connector.ranktable_parse import load_rank_table

        if not cfg.server_id:
            raise ConfigError(
                "kv_connector_extra_config.rank_table needs server_id too (this host's server_id in the table)"
            )
        table = load_rank_table(cfg.rank_table)
        role = GroupRole(cfg.role)
        tps = (
            {"prefill_tp": tp_size, "decode_tp": 1}
            if role is GroupRole.PREFILL
            else {"prefill_tp": 1, "decode_tp": tp_size}
        )
        place = find_placement(assign_ranks(table, **tps), role, cfg.server_id, dp_rank, tp_rank)
        return from_placement(place, visible_device_id=device_index, env=env)
    visible = tp_rank if device_index is None else device_index
    return discover(cfg, visible_device_id=visible, tp_size=tp_size, env=env, hccn_text=_read_text(cfg.hccn_conf))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None

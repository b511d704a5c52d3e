"""Every failure the connector reports, each a `pdgate.errors.PDGateError` with its `Code`.

Callers branch on the class or the code, never on a message. The code also travels: in a failed pull's
`PullOutcome`, and in the reason of the abort a decode sends when its load fails, so the metaserver's
handoff record says why.

    PDGateError (pdgate.errors)
    ├── ConfigError               config_error            kv_connector_extra_config is wrong (engine start)
    │   ├── DeviceNotFound        connector_device_unknown no source names this worker's NPU IP
    │   └── RankTableError        ranktable_invalid       a malformed rank table, with the path of the fault
    ├── LocationError             pd_location_mismatch    a decode cannot use the KV location it was given
    ├── BlockPlanError            pd_block_plan_invalid   the prefill's blocks cannot fill the decode's
    ├── TPLayoutError             pd_tp_layout_unsupported the TP layouts of P and D cannot be mapped
    ├── InvalidTransferParams     pd_invalid_transfer_params (pdgate.contract)
    └── TransportError            transport_*             (pdgate.connector.transport.errors has that tree)

Failures of the metaserver's client (`pdgate.meta_client.MetaError`) are mapped onto codes by one
table in `control.py`.
"""

from __future__ import annotations

from pdgate.errors import Code, PDGateError

__all__ = ["BlockPlanError", "ConfigError", "DeviceNotFound", "LocationError", "RankTableError", "TPLayoutError"]


class ConfigError(PDGateError):
    """The connector's configuration is wrong; the message names the key and says what is expected."""

    code = Code.CONFIG_ERROR


class DeviceNotFound(ConfigError):
    """No source names this worker's device IP (or the sources disagree with a rank table)."""

    code = Code.DEVICE_NOT_FOUND


class RankTableError(ConfigError):
    """A malformed rank table. `path` locates the fault (`server_group_list[1].server_list[0]...`),
    `reason` says what is wrong."""

    code = Code.RANKTABLE_INVALID

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}", path=path)
        self.path = path
        self.reason = reason


class LocationError(PDGateError):
    """A decode cannot use this KV location; `code` says why (layout, TP, blocks, or the location itself)."""

    code = Code.LOCATION_MISMATCH


class BlockPlanError(PDGateError):
    """The prefill's blocks cannot fill the decode's blocks (counts disagree)."""

    code = Code.BLOCK_PLAN_INVALID


class TPLayoutError(PDGateError):
    """The prefill's and decode's tensor-parallel layouts cannot be mapped onto each other."""

    code = Code.TP_LAYOUT_UNSUPPORTED

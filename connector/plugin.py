"""`vllm.general_plugins` entry point: makes `"kv_connector": "PDGateConnector"` resolve without a module path.

vLLM calls every general plugin once in each of its processes (API server, engine core, workers), so
`register()` must be idempotent and cheap: it records a lazy (module, class) pair in vLLM's connector
registry and imports nothing heavy. pyproject: `pdgate_connector = "pdgate.connector.plugin:register"`.
"""

from __future__ import annotations

import logging

__all__ = ["CONNECTOR_NAME", "register"]

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "PDGateConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdgate.connector.connector", CONNECTOR_NAME)
    except ValueError:
        # Already registered in this process (vLLM loads plugins once per process, but a test or a
        # second entry point may call us again). Registration is lazy, so there is nothing to refresh.
        logger.debug("%s is already registered with vLLM's KVConnectorFactory", CONNECTOR_NAME)

"""pdgate's vLLM v1 KV connector: `PDGateConnector` and its two halves.

vLLM imports this package in every process that builds a `VllmConfig`, the API server included
(`kv_connector_module_path="pdgate.connector"`), so importing it must stay cheap: no torch, no vLLM, no
transport engine. `PDGateConnector` is resolved lazily through the module `__getattr__` below, which
vLLM's `getattr(module, "PDGateConnector")` triggers only where the class is really needed.

Reading path (README.md has the whole of it, with the config keys and the metrics): `connector.py`
(facade) -> `scheduler.py` (pure bookkeeping, engine-core process) and `worker.py` (transport owner,
worker processes); `metadata.py` is everything that crosses between them, `location.py` the KV location
P records and D checks, `messages.py` what crosses to the control thread (`control.py`, `registration.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["PDGateConnector"]

if TYPE_CHECKING:
    from pdgate.connector.connector import PDGateConnector


def __getattr__(name: str) -> Any:
    if name == "PDGateConnector":
        from pdgate.connector.connector import PDGateConnector

        return PDGateConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")

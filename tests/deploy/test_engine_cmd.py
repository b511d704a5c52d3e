"""deploy/docker/engine_cmd.py (the engines' entrypoint) and healthcheck.py, fed with what compose renders.

The environment of each case is the `environment:` block docker-compose renders for the service from the
shipped env files, so these tests check the chain env file -> compose -> entrypoint -> vLLM/connector.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pdgate.connector.config import ServerFacts, parse_config

from tests.deploy.support import DOCKER_DIR, ENV_FILES, clean_env, load_engine_cmd, read_env_file, render
from tests.support.ports import free_port

ec = load_engine_cmd()


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, str]]:
    """Rendered container environments, per service, for a prefill and a decode host."""
    out: dict[str, dict[str, str]] = {}
    for role, addr in (("prefill", "10.77.0.11"), ("decode", "10.77.0.21")):
        config = render(ENV_FILES[role], {"PDGATE_HOST_ADDR": addr, "PDGATE_HOST_NIC": "eth7"})
        for flavour in ("cpu", "ascend", "sim"):
            name = f"{role}-{flavour}"
            out[name] = {k: "" if v is None else str(v) for k, v in config["services"][name]["environment"].items()}
    return out


def _extra(argv: list[str]) -> dict[str, Any]:
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "PDGateConnector"
    assert cfg["kv_connector_module_path"] == "pdgate.connector"
    extra: dict[str, Any] = cfg["kv_connector_extra_config"]
    return extra


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cpu_engine_command_is_accepted_by_the_connector(role: str, services: dict[str, dict[str, str]]) -> None:
    env = services[f"{role}-cpu"]
    files = read_env_file(ENV_FILES[role])
    spec = ec.EngineSpec.from_env(env)
    argv = ec.engine_argv(spec, "python3")
    assert argv[:5] == ["python3", "-m", "pdgate.deploy.local.vllm_cli", "serve", ec.DEFAULT_TINY_MODEL]
    port = files[f"PDGATE_{role.upper()}_PORT"]
    assert argv[argv.index("--port") + 1] == port
    assert argv[argv.index("--served-model-name") + 1] == files["PDGATE_SERVED_MODEL_NAME"]
    assert argv[argv.index("--block-size") + 1] == files["PDGATE_BLOCK_SIZE"]
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert cfg["kv_buffer_device"] == "cpu"
    # The real connector parses the extra config: unknown keys or wrong types would raise here. The
    # metaserver token is not on the command line (ps shows it): the engine's environment carries it.
    assert env["PDGATE_CONNECTOR_METASERVER_TOKEN"] not in " ".join(argv)
    engine_environment = env | ec.engine_env(spec)
    parsed = parse_config(cfg["kv_connector_extra_config"], ServerFacts(kv_role=cfg["kv_role"]), engine_environment)
    addr = env["PDGATE_ENGINE_ADVERTISE_ADDR"]
    assert parsed.url == f"http://{addr}:{port}"
    assert parsed.instance_id == f"{role}-{addr}-{port}" == cfg["engine_id"]
    assert parsed.metaserver_url == f"http://{files['PDGATE_HEAD_ADDR']}:{files['PDGATE_HEAD_METASERVER_PORT']}"
    assert parsed.metaserver_token == files["PDGATE_ADMIN_TOKEN"]
    assert parsed.transport == "nixl"
    assert parsed.model == files["PDGATE_SERVED_MODEL_NAME"]
    assert parsed.role == role


def test_every_engine_launcher_writes_the_connectors_own_names_not_its_aliases(
    services: dict[str, dict[str, str]],
) -> None:
    """The connector reads PDGATE_CONNECTOR_METASERVER_URL/_TOKEN (the older PDGATE_METASERVER_* are only
    aliases, in the metaserver's own namespace): compose, the entrypoint and pdgate-local write the new ones."""
    from pdgate.connector import config
    from pdgate.deploy.local import stack

    own = {config.ENV_METASERVER_URL, config.ENV_METASERVER_TOKEN}
    aliases = {"PDGATE_METASERVER_URL", "PDGATE_METASERVER_TOKEN"}
    for name in ("prefill-cpu", "decode-cpu", "prefill-ascend", "decode-ascend"):
        assert own <= services[name].keys() and not aliases & services[name].keys(), name
    for name in ("prefill-cpu", "decode-cpu"):
        assert ec.engine_env(ec.EngineSpec.from_env(services[name])).keys() == {config.ENV_METASERVER_TOKEN}
    assert stack.ENGINE_TOKEN_ENV == config.ENV_METASERVER_TOKEN


HCCN_SAMPLE = "address_0=192.168.100.100\nnetmask_0=255.255.255.0\naddress_1=192.168.101.100\n"


def no_hccn(path: str) -> str | None:
    return None


def test_ascend_engine_uses_llmdatadist_and_the_rank_table(services: dict[str, dict[str, str]]) -> None:
    env = services["prefill-ascend"] | {"PDGATE_ENGINE_MODEL": "/models/Qwen3-8B"}
    spec = ec.EngineSpec.from_env(
        env, file_exists=lambda path: path == env["PDGATE_ENGINE_RANKTABLE"], read_text=no_hccn
    )
    argv = ec.engine_argv(spec, "python3")
    assert "--enforce-eager" not in argv and "--dtype" not in argv  # CPU-only flags
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_buffer_device"] == "npu"
    parsed = parse_config(cfg["kv_connector_extra_config"], ServerFacts(kv_role=cfg["kv_role"]))
    assert parsed.transport == "llmdatadist"
    assert parsed.rank_table == "/etc/pdgate/ranktable.json"
    assert parsed.server_id == "10.77.0.11"  # default: the host address
    assert parsed.transport_options == {"listen_port": int(env["PDGATE_ENGINE_KV_PORT"])}
    assert parsed.model == env["PDGATE_ENGINE_SERVED_MODEL_NAME"]
    assert argv[4] == "/models/Qwen3-8B"

    # No rank table mounted (the compose file mounts /dev/null) and no NPU addresses: refused at once,
    # naming the variable.
    with pytest.raises(ec.ConfigError, match="PDGATE_RANKTABLE_PATH") as err:
        ec.EngineSpec.from_env(env, file_exists=lambda path: False, read_text=no_hccn)
    assert "/etc/hccn.conf is missing" in str(err.value) and "PDGATE_DEVICE_IP" in str(err.value)
    with pytest.raises(ec.ConfigError, match="has no address_<id>= lines"):
        ec.EngineSpec.from_env(env, file_exists=lambda path: False, read_text=lambda path: "netmask_0=255.0.0.0\n")


@pytest.mark.parametrize("source", ["hccn.conf", "PDGATE_DEVICE_IP"])
def test_ascend_engine_without_a_rank_table_uses_the_npu_addresses(
    source: str, services: dict[str, dict[str, str]]
) -> None:
    env = services["decode-ascend"] | {"PDGATE_ENGINE_MODEL": "/models/Qwen3-8B"}
    read = (lambda path: HCCN_SAMPLE if path == ec.HCCN_CONF else None) if source == "hccn.conf" else no_hccn
    if source == "PDGATE_DEVICE_IP":
        env = env | {"PDGATE_DEVICE_IP": "0=192.168.100.100"}
    spec = ec.EngineSpec.from_env(env, file_exists=lambda path: False, read_text=read)
    assert spec.ranktable is None
    cfg = json.loads(ec.engine_argv(spec)[ec.engine_argv(spec).index("--kv-transfer-config") + 1])
    parsed = parse_config(cfg["kv_connector_extra_config"], ServerFacts(kv_role=cfg["kv_role"]))
    assert parsed.transport == "llmdatadist" and parsed.rank_table is None


def test_device_address_requirement_is_the_connectors(tmp_path: Any) -> None:
    """The entrypoint accepts an Ascend engine without a rank table exactly when the connector can place
    its workers: both read the address_<id> lines of hccn.conf (and $PDGATE_DEVICE_IP) the same way."""
    from pdgate.connector.config import ConfigError, ConnectorConfig
    from pdgate.connector.devices import parse_hccn_conf
    from pdgate.connector.transport.factory import make_transport

    assert ec.hccn_device_ids(HCCN_SAMPLE) == sorted(parse_hccn_conf(HCCN_SAMPLE)) == [0, 1]
    assert ec.hccn_device_ids("netmask_0=255.0.0.0\n") == sorted(parse_hccn_conf("netmask_0=255.0.0.0\n")) == []

    def connector_accepts(hccn_text: str | None, env: dict[str, str]) -> bool:
        hccn = tmp_path / "hccn.conf"
        if hccn_text is None:
            hccn.unlink(missing_ok=True)
        else:
            hccn.write_text(hccn_text)
        cfg = ConnectorConfig(
            metaserver_url="http://10.77.0.1:8300",
            instance_id="prefill-10.77.0.11-8100",
            url="http://10.77.0.11:8100",
            model="m",
            role="prefill",
            transport="llmdatadist",
            server_id="10.77.0.11",
            hccn_conf=str(hccn),
        )
        try:
            make_transport(cfg, tp_rank=0, dp_rank=0, tp_size=1, env=env)
        except ConfigError:
            return False
        except ImportError:  # got past the placement: llm_datadist itself is absent here
            return True
        return True

    base = {"PDGATE_ENGINE_FLAVOUR": "ascend"}
    for hccn_text, env in ((HCCN_SAMPLE, {}), (None, {}), (None, {"PDGATE_DEVICE_IP": "10.1.1.1"})):
        try:
            ec.EngineSpec.from_env(base | env, read_text=lambda path, t=hccn_text: t)
            entrypoint_accepts = True
        except ec.ConfigError as exc:
            entrypoint_accepts = not any("PDGATE_ENGINE_RANKTABLE" in p for p in exc.problems)
        assert entrypoint_accepts == connector_accepts(hccn_text, env), (hccn_text, env)


def test_ascend_needs_a_model_a_nic_and_a_rank_table_or_npu_addresses(services: dict[str, dict[str, str]]) -> None:
    env = services["decode-ascend"] | {"HCCL_SOCKET_IFNAME": "all"}
    with pytest.raises(ec.ConfigError) as err:
        ec.EngineSpec.from_env(env, read_text=no_hccn)  # /etc/pdgate/ranktable.json does not exist here
    text = str(err.value)
    assert "PDGATE_MODEL" in text and "PDGATE_HOST_NIC" in text and "PDGATE_RANKTABLE_PATH" in text


def test_lease_comes_with_a_heartbeat_inside_it(services: dict[str, dict[str, str]]) -> None:
    env = services["decode-cpu"] | {"PDGATE_ENGINE_LEASE_S": "3"}
    extra = _extra(ec.engine_argv(ec.EngineSpec.from_env(env)))
    parsed = parse_config(extra, ServerFacts(kv_role="kv_consumer"))
    assert parsed.lease_s == 3.0 and parsed.heartbeat_s < parsed.lease_s


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"PDGATE_ENGINE_ADVERTISE_ADDR": ""}, ["PDGATE_HOST_ADDR"]),
        ({"PDGATE_ENGINE_ADVERTISE_ADDR": "0.0.0.0"}, ["PDGATE_HOST_ADDR"]),
        ({"PDGATE_CONNECTOR_METASERVER_URL": "http://:8300"}, ["PDGATE_HEAD_ADDR"]),
        ({"PDGATE_ENGINE_PORT": "eighty"}, ["PDGATE_PREFILL_PORT"]),
        ({"PDGATE_ENGINE_KV_PORT": "8100", "PDGATE_ENGINE_PORT": "8100"}, ["PDGATE_PREFILL_KV_PORT"]),
        ({"PDGATE_ENGINE_BLOCK_SIZE": "48"}, ["PDGATE_BLOCK_SIZE"]),
        ({"PDGATE_ENGINE_INSTANCE_ID": "bad id/1"}, ["PDGATE_PREFILL_INSTANCE_ID"]),
        ({"PDGATE_ENGINE_VLLM_ARGS": "--x 'open"}, ["PDGATE_PREFILL_VLLM_ARGS"]),
        # Every problem is reported at once, not one per restart.
        ({"PDGATE_ENGINE_ADVERTISE_ADDR": "", "PDGATE_ENGINE_PORT": "0"}, ["PDGATE_HOST_ADDR", "PDGATE_PREFILL_PORT"]),
    ],
)
def test_bad_environment_names_the_env_file_variable(
    services: dict[str, dict[str, str]], change: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(ec.ConfigError) as err:
        ec.EngineSpec.from_env(services["prefill-cpu"] | change)
    assert len(err.value.problems) == len(names)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sim_engine_registers_the_identity_a_real_engine_would(role: str, services: dict[str, dict[str, str]]) -> None:
    from pdgate.sim.settings import parse_cli

    env = services[f"{role}-sim"]
    spec = ec.EngineSpec.from_env(env)
    argv = ec.engine_argv(spec)
    assert argv[0] == "pdgate-sim"
    assert env["PDGATE_CONNECTOR_METASERVER_TOKEN"] not in argv  # the token travels in the environment
    extra_env = ec.engine_env(spec)
    assert extra_env == {"PDGATE_SIM_ADMIN_TOKEN": env["PDGATE_CONNECTOR_METASERVER_TOKEN"]}
    settings = _with_env(extra_env, lambda: parse_cli(argv[1:]))
    real = ec.EngineSpec.from_env(services[f"{role}-cpu"])
    assert settings.role == role
    assert settings.metaserver == real.metaserver_url
    assert settings.admin_token == env["PDGATE_CONNECTOR_METASERVER_TOKEN"]
    assert settings.advertise_url == real.url
    assert settings.instance_id == real.instance_id
    assert settings.model == real.served_model_name
    assert settings.block_size == real.block_size
    assert (settings.host, settings.port) == (real.bind_addr, real.port)


def _with_env(env: dict[str, str], fn: Any) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return fn()


def test_ipv6_host_addresses_are_bracketed(services: dict[str, dict[str, str]]) -> None:
    spec = ec.EngineSpec.from_env(services["decode-sim"] | {"PDGATE_ENGINE_ADVERTISE_ADDR": "fd00::21"})
    assert spec.url == f"http://[fd00::21]:{spec.port}"
    assert spec.instance_id == f"decode-fd00::21-{spec.port}"


def test_entrypoint_prints_the_command_or_refuses(services: dict[str, dict[str, str]]) -> None:
    script = str(DOCKER_DIR / "engine_cmd.py")
    ok = subprocess.run(
        [sys.executable, script, "--print"], env=clean_env(services["prefill-sim"]), capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == ec.engine_argv(ec.EngineSpec.from_env(services["prefill-sim"]), sys.executable)
    bad = subprocess.run(
        [sys.executable, script, "--check"],
        env=clean_env(services["prefill-sim"] | {"PDGATE_ENGINE_ADVERTISE_ADDR": ""}),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "set PDGATE_HOST_ADDR" in bad.stderr


# ------------------------------------------------------------------ waiting for the head, healthchecks


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    server.status = 200  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_wait_for_metaserver_returns_once_healthy(health_server: http.server.HTTPServer) -> None:
    url = f"http://127.0.0.1:{health_server.server_address[1]}"
    assert ec.wait_for_metaserver(url, 5, log=lambda _: None)


def test_wait_for_metaserver_gives_up_at_its_deadline() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert not ec.wait_for_metaserver(url, 10, clock=lambda: now[0], sleep=sleep, log=lambda _: None)
    assert now[0] >= 10 and all(s <= 2.0 for s in sleeps)


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> int:
    cmd = [sys.executable, str(DOCKER_DIR / "healthcheck.py"), *args]
    return subprocess.run(cmd, env=clean_env(env), capture_output=True, check=False).returncode


def test_healthcheck_exit_status_follows_the_endpoint(health_server: http.server.HTTPServer) -> None:
    url = f"http://127.0.0.1:{health_server.server_address[1]}/health"
    assert _healthcheck(url) == 0
    assert _healthcheck(env={"PDGATE_HEALTHCHECK_URL": url}) == 0
    health_server.status = 503  # type: ignore[attr-defined]
    assert _healthcheck(url) == 1
    assert _healthcheck(f"http://127.0.0.1:{free_port()}/health", "--timeout", "1") == 1


def test_healthcheck_finds_the_metaservers_port_by_its_new_name_then_its_older_one(
    health_server: http.server.HTTPServer,
) -> None:
    """The metaserver's port is PDGATE_METASERVER_PORT (PDGATE_PORT, its older name, still works; the new
    name wins, as in the metaserver itself). Before, only PDGATE_PORT was read: 8300 was probed instead."""
    port, dead = str(health_server.server_address[1]), str(free_port())
    assert _healthcheck("--timeout", "2", env={"PDGATE_METASERVER_PORT": port}) == 0
    assert _healthcheck("--timeout", "2", env={"PDGATE_METASERVER_PORT": port, "PDGATE_PORT": dead}) == 0
    assert _healthcheck("--timeout", "2", env={"PDGATE_PORT": port}) == 0
    assert _healthcheck("--timeout", "2", env={"PDGATE_METASERVER_PORT": dead, "PDGATE_PORT": port}) == 1


def test_tiny_model_defaults_match_the_model_builder() -> None:
    """The entrypoint (stdlib only) repeats two facts of deploy/local/tiny_model.py; keep them equal."""
    from pdgate.deploy.local import tiny_model

    assert ec.DEFAULT_SERVED_NAME == tiny_model.MODEL_NAME
    assert tiny_model._STAMP == "pdgate-tiny.json"  # what _ensure_tiny_model looks for
    assert ec.DEFAULT_TINY_MODEL.endswith("/" + tiny_model.MODEL_NAME)

"""docker-compose.yml and deploy/env/*.env render with Debian's docker-compose and say what deploy/README.md promises.

Rendered once per module (each `docker-compose config` run costs ~0.5 s) and asserted on the parsed YAML.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.support import (
    COMPOSE_FILE,
    ENV_FILES,
    depends_on,
    enabled_services,
    profiles_of,
    published_ports,
    read_env_file,
    render,
    run_config,
)

HEAD_SERVICES = {"redis", "metaserver", "router"}
OBSERVABILITY = {"prometheus", "grafana"}
ENGINES = {f"{role}-{flavour}" for role in ("prefill", "decode") for flavour in ("cpu", "ascend", "sim")}
HA = {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}  # tests/store_ha/test_compose_ha.py
ALL_SERVICES = HEAD_SERVICES | OBSERVABILITY | ENGINES | HA


@pytest.fixture(scope="module")
def env() -> dict[str, dict[str, str]]:
    return {role: read_env_file(path) for role, path in ENV_FILES.items()}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    return {role: render(path) for role, path in ENV_FILES.items()}


# ------------------------------------------------------------------ every env file and profile renders


def test_each_env_file_starts_its_hosts_services(env: dict[str, dict[str, str]], rendered: dict[str, Any]) -> None:
    expected = {"head": HEAD_SERVICES, "prefill": {"prefill-cpu"}, "decode": {"decode-cpu"}}
    for role, config in rendered.items():
        assert set(config["services"]) == ALL_SERVICES
        assert enabled_services(config, profiles_of(env[role])) == expected[role], role


@pytest.mark.parametrize(
    ("profiles", "services"),
    [
        (["head"], HEAD_SERVICES),
        (["head", "observability"], HEAD_SERVICES | OBSERVABILITY),
        (["observability"], OBSERVABILITY),
        (["cpu"], {"prefill-cpu", "decode-cpu"}),
        (["ascend"], {"prefill-ascend", "decode-ascend"}),
        (["sim"], {"prefill-sim", "decode-sim"}),
        (["prefill-ascend"], {"prefill-ascend"}),
        (["decode-ascend"], {"decode-ascend"}),
        (["prefill-sim"], {"prefill-sim"}),
        (["decode-sim"], {"decode-sim"}),
        (["head", "cpu"], HEAD_SERVICES | {"prefill-cpu", "decode-cpu"}),
        ([], set()),
    ],
)
def test_every_profile_selects_a_consistent_set(
    rendered: dict[str, Any], profiles: list[str], services: set[str]
) -> None:
    # enabled_services also fails when a chosen service depends on one the profiles leave out.
    assert enabled_services(rendered["head"], profiles) == services


def test_profile_set_by_env_overrides_the_file() -> None:
    config = render(ENV_FILES["prefill"], {"COMPOSE_PROFILES": "prefill-ascend"})
    assert enabled_services(config, ["prefill-ascend"]) == {"prefill-ascend"}


def test_single_host_recipe_renders_everything_on_one_box(env: dict[str, dict[str, str]]) -> None:
    """deploy/README.md: the three files concatenated, profiles and addresses from the shell."""
    overrides = {"COMPOSE_PROFILES": "head,cpu", "PDGATE_HEAD_ADDR": "10.1.2.3", "PDGATE_HOST_ADDR": "10.1.2.3"}
    config = render(list(ENV_FILES.values()), overrides)
    assert enabled_services(config, ["head", "cpu"]) == HEAD_SERVICES | {"prefill-cpu", "decode-cpu"}
    p = config["services"]["prefill-cpu"]["environment"]
    d = config["services"]["decode-cpu"]["environment"]
    assert p["PDGATE_ENGINE_ADVERTISE_ADDR"] == d["PDGATE_ENGINE_ADVERTISE_ADDR"] == "10.1.2.3"
    # Both engines share the host network: their ports must not collide with each other or the head's.
    host_ports = {int(p["PDGATE_ENGINE_PORT"]), int(d["PDGATE_ENGINE_PORT"])}
    host_ports |= {int(p["PDGATE_ENGINE_KV_PORT"]), int(d["PDGATE_ENGINE_KV_PORT"])}
    for name in HEAD_SERVICES:
        host_ports |= {published for _, published, _ in published_ports(config["services"][name])}
    assert len(host_ports) == 7


# ------------------------------------------------------------------ health-gated start-up, restarts


def test_every_service_has_a_healthcheck_and_a_restart_policy(rendered: dict[str, Any]) -> None:
    for name, svc in rendered["head"]["services"].items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), name
        assert svc.get("restart") == "unless-stopped", name


def test_head_starts_in_dependency_order_gated_on_health(rendered: dict[str, Any]) -> None:
    services = rendered["head"]["services"]
    assert depends_on(services["metaserver"]) == {"redis": "service_healthy"}
    assert depends_on(services["router"]) == {"metaserver": "service_healthy"}
    assert depends_on(services["grafana"]) == {"prometheus": "service_healthy"}
    assert depends_on(services["redis"]) == {}
    assert depends_on(services["prometheus"]) == {}


def test_engines_use_the_host_network_and_gate_themselves(rendered: dict[str, Any]) -> None:
    for name in ENGINES:
        svc = rendered["prefill"]["services"][name]
        assert svc["network_mode"] == "host", name
        assert "ports" not in svc, name  # nothing to publish on the host network
        # The head is on another host: compose cannot gate on it, the entrypoint waits for it.
        assert depends_on(svc) == {}, name
        assert svc["entrypoint"] == ["pdgate-engine"], name
        assert svc["healthcheck"]["test"] == ["CMD", "pdgate-healthcheck"], name
        assert int(svc["environment"]["PDGATE_ENGINE_WAIT_S"]) > 0, name


def test_healthchecks_point_at_the_ports_the_services_listen_on(rendered: dict[str, Any]) -> None:
    services = rendered["head"]["services"]
    assert services["metaserver"]["healthcheck"]["test"][-1] == (
        f"http://127.0.0.1:{services['metaserver']['environment']['PDGATE_METASERVER_PORT']}/health"
    )
    assert services["router"]["healthcheck"]["test"][-1] == (
        f"http://127.0.0.1:{services['router']['environment']['PDGATE_ROUTER_PORT']}/health"
    )
    for name in ENGINES:
        e = rendered["prefill"]["services"][name]["environment"]
        assert e["PDGATE_HEALTHCHECK_URL"] == (
            f"http://{e['PDGATE_ENGINE_ADVERTISE_ADDR']}:{e['PDGATE_ENGINE_PORT']}/health"
        ), name


# ------------------------------------------------------------------ addresses and ports come from the env files


def test_compose_file_names_no_host_address() -> None:
    text = COMPOSE_FILE.read_text()
    literals = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", text))
    assert literals <= {"0.0.0.0", "127.0.0.1"}, literals


def test_head_publishes_on_the_env_files_ports(env: dict[str, dict[str, str]], rendered: dict[str, Any]) -> None:
    h = env["head"]
    services = rendered["head"]["services"]

    def published(name: str) -> set[tuple[str, int, int]]:
        return published_ports(services[name])

    bind = h["PDGATE_HEAD_BIND_ADDR"]
    assert published("metaserver") == {(bind, int(h["PDGATE_HEAD_METASERVER_PORT"]), 8300)}
    assert published("router") == {(bind, int(h["PDGATE_ROUTER_PORT"]), 8000)}
    assert published("redis") == {(h["PDGATE_REDIS_PUBLISH_ADDR"], int(h["PDGATE_REDIS_PORT"]), 6379)}
    obs = h["PDGATE_OBSERVABILITY_BIND_ADDR"]
    assert published("prometheus") == {(obs, int(h["PDGATE_PROMETHEUS_PORT"]), 9090)}
    assert published("grafana") == {(obs, int(h["PDGATE_GRAFANA_PORT"]), 3000)}


def test_the_metaservers_published_port_is_not_its_own_port_setting(env: dict[str, dict[str, str]]) -> None:
    """The env files name the host port the head publishes; the metaserver reads PDGATE_METASERVER_PORT as
    its own --port. Were they one name, another published port would move the port it listens on away from
    the one published and probed (8300 inside its network)."""
    from pdgate.metaserver.settings import COMMAND_ENV_PREFIX, MetaSettings

    own = {COMMAND_ENV_PREFIX + name.upper() for name in MetaSettings.model_fields}
    for role, values in env.items():
        assert not own & set(values), role
    services = render(ENV_FILES["head"], {"PDGATE_HEAD_METASERVER_PORT": "9300"})["services"]
    assert {port for _, port, _ in published_ports(services["metaserver"])} == {9300}
    assert {inner for _, _, inner in published_ports(services["metaserver"])} == {8300}
    assert services["metaserver"]["environment"]["PDGATE_METASERVER_PORT"] == "8300"
    assert services["metaserver"]["healthcheck"]["test"][-1] == "http://127.0.0.1:8300/health"


def test_head_services_are_wired_to_each_other(env: dict[str, dict[str, str]], rendered: dict[str, Any]) -> None:
    h = env["head"]
    services = rendered["head"]["services"]
    m = services["metaserver"]["environment"]
    r = services["router"]["environment"]
    assert m["PDGATE_METASERVER_HOST"] == "0.0.0.0"
    assert m["PDGATE_METASERVER_STORE"] == f"redis://:{h['PDGATE_REDIS_PASSWORD']}@redis:6379/0"
    assert m["PDGATE_METASERVER_ADMIN_TOKEN"] == h["PDGATE_ADMIN_TOKEN"]
    assert m["PDGATE_METASERVER_INSTANCE_LEASE_S"] == h["PDGATE_INSTANCE_LEASE_S"]
    assert r["PDGATE_ROUTER_HOST"] == "0.0.0.0"
    assert r["PDGATE_ROUTER_METASERVER"] == f"http://metaserver:{m['PDGATE_METASERVER_PORT']}"
    assert r["PDGATE_ROUTER_METASERVER_TOKEN"] == h["PDGATE_ADMIN_TOKEN"]
    # Engines are told where to reach the metaserver: the head's address, not the service name.
    assert (
        r["PDGATE_ROUTER_ADVERTISE_METASERVER"] == f"http://{h['PDGATE_HEAD_ADDR']}:{h['PDGATE_HEAD_METASERVER_PORT']}"
    )
    assert r["PDGATE_ROUTER_PREFILL_POLICY"] == h["PDGATE_ROUTER_PREFILL_POLICY"]
    assert r["PDGATE_ROUTER_DECODE_POLICY"] == h["PDGATE_ROUTER_DECODE_POLICY"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_take_their_identity_from_their_env_file(role: str, env: dict[str, dict[str, str]]) -> None:
    e = env[role]
    config = render(ENV_FILES[role], {"PDGATE_HOST_ADDR": "10.9.8.7"})
    R = role.upper()
    for flavour in ("cpu", "ascend", "sim"):
        v = config["services"][f"{role}-{flavour}"]["environment"]
        assert v["PDGATE_ENGINE_ROLE"] == role
        assert v["PDGATE_ENGINE_FLAVOUR"] == flavour
        assert v["PDGATE_ENGINE_ADVERTISE_ADDR"] == "10.9.8.7"
        assert v["VLLM_HOST_IP"] == "10.9.8.7"
        assert (
            v["PDGATE_CONNECTOR_METASERVER_URL"] == f"http://{e['PDGATE_HEAD_ADDR']}:{e['PDGATE_HEAD_METASERVER_PORT']}"
        )
        assert v["PDGATE_CONNECTOR_METASERVER_TOKEN"] == e["PDGATE_ADMIN_TOKEN"]
        assert v["PDGATE_ENGINE_PORT"] == e[f"PDGATE_{R}_PORT"]
        assert v["PDGATE_ENGINE_KV_PORT"] == e[f"PDGATE_{R}_KV_PORT"]
        assert v["PDGATE_ENGINE_TP_SIZE"] == e[f"PDGATE_{R}_TP_SIZE"]
        assert v["PDGATE_ENGINE_SERVED_MODEL_NAME"] == e["PDGATE_SERVED_MODEL_NAME"]
        assert v["PDGATE_ENGINE_BLOCK_SIZE"] == e["PDGATE_BLOCK_SIZE"]
    cpu = config["services"][f"{role}-cpu"]["environment"]
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == e[f"PDGATE_{R}_KVCACHE_GIB"]
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == e[f"PDGATE_{R}_CPU_BIND"]
    assert cpu["UCX_NET_DEVICES"] == e["PDGATE_HOST_NIC"]
    ascend = config["services"][f"{role}-ascend"]["environment"]
    assert ascend["ASCEND_RT_VISIBLE_DEVICES"] == e[f"PDGATE_{R}_NPUS"]
    assert ascend["HCCL_IF_IP"] == "10.9.8.7"


def test_engine_variables_come_from_where_the_entrypoint_says() -> None:
    """engine_cmd.ENV_FILE_SOURCE names the env-file variable to fix in its error messages: give every
    named variable a distinct value and check it arrives in the container variable it claims to set."""
    from tests.deploy.support import load_engine_cmd

    sources: dict[str, str] = load_engine_cmd().ENV_FILE_SOURCE
    for role in ("prefill", "decode"):
        checked = {var: src.replace("{ROLE}", role.upper()) for var, src in sources.items()}
        checked.pop("PDGATE_ENGINE_RANKTABLE")  # a fixed in-container path; its source is a mount
        names = sorted({n for src in checked.values() for n in re.findall(r"PDGATE_[A-Z_]+", src)})
        sentinel = {name: str(41000 + i) for i, name in enumerate(names)}  # numbers are valid anywhere
        services = render(ENV_FILES[role], sentinel)["services"]
        for flavour in ("cpu", "ascend", "sim"):
            environment = services[f"{role}-{flavour}"]["environment"]
            for var, source in checked.items():
                if var == "PDGATE_ENGINE_SERVER_ID" and flavour != "ascend":
                    continue
                for name in re.findall(r"PDGATE_[A-Z_]+", source):
                    assert sentinel[name] in str(environment[var]), (role, flavour, var, name, environment[var])


def test_ascend_engines_get_devices_driver_and_rank_table(tmp_path: Any) -> None:
    table = tmp_path / "ranktable.json"
    table.write_text("{}")
    config = render(ENV_FILES["prefill"], {"PDGATE_RANKTABLE_PATH": str(table), "PDGATE_SERVER_ID": "srv-7"})
    default = render(ENV_FILES["prefill"])
    for role in ("prefill", "decode"):
        svc = config["services"][f"{role}-ascend"]
        devices = {d if isinstance(d, str) else d["source"] for d in svc["devices"]}
        devices = {d.split(":")[0] for d in devices}
        assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
        assert {f"/dev/davinci{i}" for i in range(8)} <= devices
        mounts = {v.split(":")[0]: v.split(":")[1] for v in svc["volumes"]}
        for host_path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                          "/etc/ascend_install.info", "/etc/hccn.conf"):  # fmt: skip
            assert mounts[host_path] == host_path
        assert mounts[str(table)] == svc["environment"]["PDGATE_ENGINE_RANKTABLE"]
        assert svc["environment"]["PDGATE_ENGINE_SERVER_ID"] == "srv-7"
        # Without a rank table the mount source is /dev/null: the entrypoint reads an empty file as "none".
        default_mounts = [v for v in default["services"][f"{role}-ascend"]["volumes"] if "ranktable" in v]
        assert default_mounts == [f"/dev/null:{svc['environment']['PDGATE_ENGINE_RANKTABLE']}:ro"]
        assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


def test_missing_required_cluster_values_fail_with_a_sentence() -> None:
    for var in ("PDGATE_HEAD_ADDR", "PDGATE_ADMIN_TOKEN"):
        result = run_config(ENV_FILES["decode"], {var: ""})
        assert result.returncode != 0
        assert f"set {var} in the env file" in result.stderr


# ------------------------------------------------------------------ the env files themselves


def test_cluster_wide_values_agree_across_hosts(env: dict[str, dict[str, str]]) -> None:
    head_text = ENV_FILES["head"].read_text()
    section = head_text.split("cluster-wide", 1)[1].split("# ----", 1)[0]
    cluster_keys = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", section, re.M))
    assert {"PDGATE_HEAD_ADDR", "PDGATE_HEAD_METASERVER_PORT", "PDGATE_ADMIN_TOKEN"} <= cluster_keys
    for key in cluster_keys:
        values = {role: values.get(key) for role, values in env.items()}
        assert len(set(values.values())) == 1, f"{key} differs between env files: {values}"
    shared = set(env["head"]) & set(env["prefill"]) & set(env["decode"])
    assert shared - {"COMPOSE_PROFILES"} == cluster_keys


def test_every_variable_is_commented_and_used(env: dict[str, dict[str, str]]) -> None:
    compose_text = COMPOSE_FILE.read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", compose_text))  # $${X} is for the shell
    for path in ENV_FILES.values():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^([A-Z_][A-Z0-9_]*)=", line)
            if not m:
                continue
            assert i > 0 and lines[i - 1].startswith("# "), f"{path.name}: {m.group(1)} has no comment above it"
            key = m.group(1)
            assert key.startswith("COMPOSE_") or key in used, f"{path.name}: {key} is not used by docker-compose.yml"
    # ...and every variable the compose file reads is documented in some env file.
    documented = set().union(*(set(values) for values in env.values()))
    assert used <= documented, sorted(used - documented)


def test_redis_keeps_the_ledger_with_aof_fsynced_every_second(rendered: dict[str, Any]) -> None:
    # A Redis restart must not lose READY handoffs (the prefill would hold their blocks until its local
    # deadline): AOF on, fsync every second, so a crash loses at most about a second of transitions.
    command = " ".join(rendered["head"]["services"]["redis"]["command"])
    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command

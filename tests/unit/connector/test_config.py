"""pdgate.connector.config: one parse of kv_connector_extra_config, unknown keys and bad types refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdgate.connector.config import (
    ALLOWED_KEYS,
    ServerFacts,
    discover_server,
    parse_config,
    role_for_kv_role,
    settings_table,
)
from pdgate.connector.errors import ConfigError

FACTS = ServerFacts(kv_role="kv_producer", dp_rank=1, host="10.0.0.5", port=8100, served_model="tiny")
BASE = {"metaserver_url": "http://10.0.0.2:8300/"}


def test_defaults_come_from_the_server() -> None:
    cfg = parse_config(BASE, FACTS)
    assert cfg.metaserver_url == "http://10.0.0.2:8300"
    assert cfg.url == "http://10.0.0.5:8100"
    assert cfg.instance_id == "prefill-10.0.0.5-8100-dp1"
    assert cfg.model == "tiny"
    assert cfg.role == "prefill" and cfg.can_prefill and not cfg.can_decode
    assert cfg.transport == "nixl"
    assert cfg.corrupt_pulled_bytes is False


def test_explicit_values_win() -> None:
    cfg = parse_config(
        {
            **BASE,
            "instance_id": "p0",
            "url": "http://p0.example:9000",
            "model": "m",
            "transport": "llmdatadist",
            "transport_options": {"listen_port": 26000},
            "lease_s": 20,
            "heartbeat_s": 2,
            "pull_timeout_s": 5,
            "labels": {"zone": "a"},
            "corrupt_pulled_bytes": True,
        },
        FACTS,
    )
    assert (cfg.instance_id, cfg.url, cfg.model, cfg.transport) == ("p0", "http://p0.example:9000", "m", "llmdatadist")
    assert cfg.transport_options == {"listen_port": 26000}
    assert (cfg.lease_s, cfg.heartbeat_s, cfg.pull_timeout_s) == (20.0, 2.0, 5.0)
    assert cfg.labels == {"zone": "a"} and cfg.corrupt_pulled_bytes


def test_unknown_key_is_named_with_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "metaserver_ulr": "http://x"}, FACTS)
    msg = str(err.value)
    assert "metaserver_ulr" in msg
    for key in ALLOWED_KEYS:
        assert key in msg


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("lease_s", "10", "a number"),
        ("lease_s", 0, "positive"),
        ("heartbeat_s", True, "a number"),
        ("transport", "tcp", "nixl"),
        ("metaserver_url", "10.0.0.2:8300", "http://"),
        ("instance_id", "has space", "URL-safe"),
        ("labels", {"a": 1}, "string -> string"),
        ("corrupt_pulled_bytes", "yes", "true or false"),
        ("free_margin_s", -1, ">= 0"),
        ("transport_options", ["x"], "object"),
        ("device_ips", ["10.0.0"], "IPv4"),
        ("device_ips", [167772161], "IPv4"),
        ("device_ips", {"x": "10.0.0.1"}, "device id"),
        ("device_ips", "10.0.0.1", "list"),
        ("super_device_ids", [-1], "non-negative"),
        ("super_device_ids", {"0": "7"}, "integer"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, key: value}, FACTS)
    assert f"kv_connector_extra_config.{key}" in str(err.value)
    assert expected in str(err.value)


def test_metaserver_url_is_required() -> None:
    with pytest.raises(ConfigError, match="metaserver_url is required"):
        parse_config({}, FACTS)


def test_metaserver_url_and_token_may_come_from_the_environment() -> None:
    # The token then stays off the vLLM command line (visible to everyone on the host through ps).
    env = {"PDGATE_CONNECTOR_METASERVER_URL": "http://10.0.0.3:8300/", "PDGATE_CONNECTOR_METASERVER_TOKEN": "s3cret"}
    cfg = parse_config({}, FACTS, env)
    assert (cfg.metaserver_url, cfg.metaserver_token) == ("http://10.0.0.3:8300", "s3cret")
    # A key in the extra config wins over the environment.
    cfg = parse_config({**BASE, "metaserver_token": "from-config"}, FACTS, env)
    assert (cfg.metaserver_url, cfg.metaserver_token) == ("http://10.0.0.2:8300", "from-config")
    # Empty variables are unset; without an env mapping nothing is read (tests stay hermetic).
    assert parse_config(BASE, FACTS, {"PDGATE_CONNECTOR_METASERVER_TOKEN": " "}).metaserver_token is None
    assert parse_config(BASE, FACTS).metaserver_token is None
    with pytest.raises(ConfigError, match="PDGATE_CONNECTOR_METASERVER_URL"):
        parse_config({}, FACTS, {"PDGATE_CONNECTOR_METASERVER_TOKEN": "s3cret"})


def test_the_older_variable_names_are_aliases_and_the_connectors_own_names_win() -> None:
    # PDGATE_METASERVER_* is the metaserver's own namespace (PDGATE_<COMMAND>_<FLAG>); engines set up
    # with the older names keep working.
    old = {"PDGATE_METASERVER_URL": "http://10.0.0.4:8300", "PDGATE_METASERVER_TOKEN": "old"}
    cfg = parse_config({}, FACTS, old)
    assert (cfg.metaserver_url, cfg.metaserver_token) == ("http://10.0.0.4:8300", "old")
    new = {"PDGATE_CONNECTOR_METASERVER_URL": "http://10.0.0.5:8300", "PDGATE_CONNECTOR_METASERVER_TOKEN": "new"}
    cfg = parse_config({}, FACTS, {**old, **new})
    assert (cfg.metaserver_url, cfg.metaserver_token) == ("http://10.0.0.5:8300", "new")
    # An empty new name is unset: the alias still counts.
    cfg = parse_config({}, FACTS, {**old, "PDGATE_CONNECTOR_METASERVER_TOKEN": ""})
    assert cfg.metaserver_token == "old"


@pytest.mark.parametrize("var", ["PDGATE_CONNECTOR_METASERVER_URL", "PDGATE_METASERVER_URL"])
def test_a_bad_environment_value_names_the_variable(var: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({}, FACTS, {var: "10.0.0.3:8300"})
    assert f"environment variable {var}" in str(err.value) and "http://" in str(err.value)


def test_device_tables_accept_lists_and_objects() -> None:
    cfg = parse_config(
        {
            **BASE,
            "device_ips": [None, "192.168.1.2", "192.168.1.3"],
            "super_device_ids": {"1": 8, "2": 9},
            "super_pod_id": "pod0",
            "hccn_conf": "/tmp/hccn.conf",
        },
        FACTS,
    )
    assert cfg.device_ips == {1: "192.168.1.2", 2: "192.168.1.3"}
    assert cfg.super_device_ids == {1: 8, 2: 9}
    assert (cfg.super_pod_id, cfg.hccn_conf) == ("pod0", "/tmp/hccn.conf")
    assert parse_config(BASE, FACTS).hccn_conf == "/etc/hccn.conf"


def test_url_is_required_when_it_cannot_be_discovered() -> None:
    facts = ServerFacts(kv_role="kv_consumer", host=None, port=8100, served_model="tiny")
    with pytest.raises(ConfigError, match="url is required"):
        parse_config(BASE, facts)
    cfg = parse_config({**BASE, "url": "http://d0:8200"}, facts)
    assert cfg.instance_id == "decode-d0-8200-dp0"


def test_heartbeat_must_be_below_the_lease() -> None:
    with pytest.raises(ConfigError, match="heartbeat_s"):
        parse_config({**BASE, "lease_s": 5, "heartbeat_s": 5}, FACTS)


def test_roles() -> None:
    assert [role_for_kv_role(r) for r in ("kv_producer", "kv_consumer", "kv_both")] == ["prefill", "decode", "both"]
    with pytest.raises(ConfigError, match="kv_role"):
        role_for_kv_role(None)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["vllm_cli.py", "serve", "m", "--port", "8100"], {"VLLM_HOST_IP": "127.0.0.1"}, ("127.0.0.1", 8100)),
        (["vllm_cli.py", "serve", "m", "--port=8101", "--host", "10.1.1.1"], {}, ("10.1.1.1", 8101)),
        (["vllm_cli.py", "serve", "m", "--host", "0.0.0.0"], {}, (None, 8000)),
        (["python", "-c", "x"], {}, (None, None)),
        (["vllm_cli.py", "serve", "m", "--host", "10.1.1.1"], {"VLLM_HOST_IP": "10.2.2.2"}, ("10.2.2.2", 8000)),
    ],
)
def test_discover_server(argv: list[str], env: dict[str, str], expected: tuple[str | None, int | None]) -> None:
    assert discover_server(argv, env) == expected


def test_ipv6_host_is_bracketed() -> None:
    cfg = parse_config(BASE, ServerFacts(kv_role="kv_both", host="fd00::5", port=8100, served_model="tiny"))
    assert cfg.url == "http://[fd00::5]:8100"
    assert cfg.instance_id.startswith("both-")


def test_data_parallel_ranks_get_their_own_ids() -> None:
    facts = ServerFacts(kv_role="kv_consumer", dp_rank=2, dp_size=4, host="h", port=1, served_model="m")
    assert parse_config({**BASE, "instance_id": "d0"}, facts).instance_id == "d0-dp2"
    assert parse_config({**BASE, "instance_id": "d0-dp2"}, facts).instance_id == "d0-dp2"
    assert parse_config(BASE, facts).instance_id == "decode-h-1-dp2"


def test_the_readme_table_is_the_declaration() -> None:
    readme = (Path(__file__).resolve().parents[3] / "connector" / "README.md").read_text()
    table = settings_table()
    assert table in readme, "connector/README.md is stale: paste `python -m pdgate.connector.config` into it"
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    keys = [line.split("`")[1] for line in rows if line.split("`")[1] in ALLOWED_KEYS]
    assert sorted(keys) == sorted(ALLOWED_KEYS)  # every key once, none twice

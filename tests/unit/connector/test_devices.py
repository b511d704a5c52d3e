"""pdgate.connector.devices: a worker finds its NPU (device ids, IP, cluster id) without a rank table."""

from __future__ import annotations

from typing import Any

import pytest
from pdgate.connector.config import ConnectorConfig
from pdgate.connector.devices import (
    cluster_id_for_ip,
    discover,
    from_placement,
    parse_device_ip_env,
    parse_hccn_conf,
    physical_device_id,
)
from pdgate.connector.errors import ConfigError, DeviceNotFound
from pdgate.connector.ranktable import GroupRole, assign_ranks
from pdgate.connector.ranktable_cli import generate, parse_host_spec

# As `hccn_tool -i N -ip -s address ... netmask ...` leaves it on an Atlas 800 (A2) host.
HCCN_CONF = """\
address_0=192.168.100.100
netmask_0=255.255.255.0
netdetect_0=192.168.100.1
gateway_0=192.168.100.1
send_arp_status_0=1
address_1=192.168.101.100
netmask_1=255.255.255.0
# a comment
address_4=192.168.104.100
"""


def cfg(**over: Any) -> ConnectorConfig:
    base: dict[str, Any] = dict(
        metaserver_url="http://m:1",
        instance_id="p",
        url="http://p:1",
        model="m",
        role="prefill",
        transport="llmdatadist",
    )
    return ConnectorConfig(**(base | over))


def test_hccn_conf_addresses_by_device_id() -> None:
    assert parse_hccn_conf(HCCN_CONF) == {0: "192.168.100.100", 1: "192.168.101.100", 4: "192.168.104.100"}
    assert parse_hccn_conf("") == {}


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("netmask_0=1\naddress_0=192.168.1", "line 2: address_0 is not an IPv4"),
        ("address_3=1.1.1.1\naddress_3=1.1.1.2", "line 2: address_3 is given twice"),
    ],
)
def test_hccn_conf_faults_name_the_line(text: str, fault: str) -> None:
    with pytest.raises(ValueError, match=fault):
        parse_hccn_conf(text)


def test_device_ip_env_is_one_address_or_a_table() -> None:
    assert parse_device_ip_env(" 10.0.0.7 ") == "10.0.0.7"
    assert parse_device_ip_env("0=10.0.0.7, 3=10.0.0.9") == {0: "10.0.0.7", 3: "10.0.0.9"}
    for bad in ("10.0.0", "0=10.0.0.7,x=10.0.0.8", "0:10.0.0.7"):
        with pytest.raises(ValueError):
            parse_device_ip_env(bad)


def test_visible_devices_remap_to_host_ids() -> None:
    assert physical_device_id(1, None) == 1
    assert physical_device_id(1, "") == 1
    assert physical_device_id(1, "4,5,6,7") == 5
    with pytest.raises(DeviceNotFound, match="only 2 device"):
        physical_device_id(2, "4,5")
    with pytest.raises(DeviceNotFound, match="comma-separated"):
        physical_device_id(0, "npu4")


def test_cluster_id_is_the_device_ip_as_an_integer() -> None:
    assert cluster_id_for_ip("10.0.0.1") == 10 * 2**24 + 1
    # Any usable address is >= 2**24: no clash with a rank table's running index 0..N-1.
    assert cluster_id_for_ip("1.0.0.0") == 2**24


def test_config_wins_then_the_environment_then_hccn_conf() -> None:
    env = {"PDGATE_DEVICE_IP": "4=10.9.9.4", "ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    ident = discover(cfg(device_ips={4: "10.8.8.4"}), visible_device_id=0, tp_size=2, env=env, hccn_text=HCCN_CONF)
    assert (ident.visible_device_id, ident.device_id, ident.device_ip) == (0, 4, "10.8.8.4")
    assert ident.cluster_id == cluster_id_for_ip("10.8.8.4") and "device_ips" in ident.source

    ident = discover(cfg(), visible_device_id=0, tp_size=2, env=env, hccn_text=HCCN_CONF)
    assert ident.device_ip == "10.9.9.4" and ident.source == "PDGATE_DEVICE_IP[4]"

    ident = discover(
        cfg(), visible_device_id=0, tp_size=2, env={"ASCEND_RT_VISIBLE_DEVICES": "4,5"}, hccn_text=HCCN_CONF
    )
    assert ident.device_ip == "192.168.104.100" and ident.source == "/etc/hccn.conf address_4"

    # A source that does not list this device is passed over, not taken for another device's IP.
    ident = discover(cfg(device_ips={0: "10.8.8.0"}), visible_device_id=1, tp_size=2, env={}, hccn_text=HCCN_CONF)
    assert (ident.device_id, ident.device_ip) == (1, "192.168.101.100")


def test_a3_ids_come_from_the_config() -> None:
    ident = discover(
        cfg(device_ips=[], super_device_ids={2: 10}, super_pod_id="pod1"),
        visible_device_id=2,
        tp_size=1,
        env={"PDGATE_DEVICE_IP": "10.1.1.2"},
        hccn_text=None,
    )
    assert (ident.device_ip, ident.super_device_id, ident.super_pod_id) == ("10.1.1.2", 10, "pod1")


def test_one_ip_for_several_tp_ranks_is_refused() -> None:
    env = {"PDGATE_DEVICE_IP": "10.1.1.2"}
    assert discover(cfg(), visible_device_id=0, tp_size=1, env=env, hccn_text=None).device_ip == "10.1.1.2"
    with pytest.raises(DeviceNotFound, match="share one llm_datadist cluster id"):
        discover(cfg(), visible_device_id=0, tp_size=2, env=env, hccn_text=None)


def test_no_source_says_what_was_tried_and_what_to_set() -> None:
    with pytest.raises(ConfigError) as err:
        discover(
            cfg(device_ips={0: "10.0.0.1"}),
            visible_device_id=1,
            tp_size=2,
            env={"PDGATE_DEVICE_IP": "0=10.0.0.1"},
            hccn_text=None,
        )
    msg = str(err.value)
    assert "IP of NPU 1 is unknown" in msg
    for hint in ("device_ips has devices [0]", "PDGATE_DEVICE_IP has devices [0]", "/etc/hccn.conf is absent"):
        assert hint in msg
    assert "rank_table" in msg
    with pytest.raises(DeviceNotFound, match="no address_7 line"):
        discover(cfg(), visible_device_id=7, tp_size=8, env={}, hccn_text=HCCN_CONF)
    with pytest.raises(DeviceNotFound, match=r"/etc/hccn.conf: line 1"):
        discover(cfg(), visible_device_id=0, tp_size=1, env={}, hccn_text="address_0=nope")


def test_a_rank_table_placement_is_checked_against_the_kv_cache_device() -> None:
    table = generate([parse_host_spec("10.1.0.1:2=192.168.1.3,3=192.168.1.4")], [parse_host_spec("10.1.0.2:1.1.1.1")])
    place = assign_ranks(table, prefill_tp=2, decode_tp=1)[1]
    assert (place.role, place.tp_rank, place.device_id) == (GroupRole.PREFILL, 1, 3)

    ident = from_placement(place, visible_device_id=1, env={"ASCEND_RT_VISIBLE_DEVICES": "2,3"})
    assert (ident.visible_device_id, ident.device_id, ident.device_ip) == (1, 3, "192.168.1.4")
    assert ident.cluster_id == place.cluster_id and ident.source == "rank table"

    # Host-memory KV cache: nothing to check, the table's device is used as is.
    assert from_placement(place, visible_device_id=None, env={}).visible_device_id == 3

    with pytest.raises(DeviceNotFound, match="on device 3, but its KV cache is on device 1"):
        from_placement(place, visible_device_id=1, env={})

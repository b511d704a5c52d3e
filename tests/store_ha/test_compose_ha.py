"""docker-compose.yml's `ha` profile renders (Debian's docker-compose) into what deploy/README.md says:
Redis with AOF everysec, one replica, three Sentinels with quorum 2, and a metaserver that follows them."""

from __future__ import annotations

from typing import Any

from pdgate.metaserver.store.redis_urls import parse_store_url

from tests.deploy.support import ENV_FILES, enabled_services, render

HA_ENV = {
    "COMPOSE_PROFILES": "head,ha",
    "PDGATE_REDIS_PASSWORD": "pw1",
    "PDGATE_REDIS_SCHEME": "redis+sentinel",
    "PDGATE_REDIS_ENDPOINT": "sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/pdgate/0",
}


def _head(overrides: dict[str, str]) -> dict[str, Any]:
    return render(ENV_FILES["head"], overrides)


def test_ha_profile_adds_a_replica_and_three_sentinels_to_the_head() -> None:
    config = _head(HA_ENV)
    ha = {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
    assert enabled_services(config, ["head", "ha"]) == {"redis", "metaserver", "router"} | ha
    assert enabled_services(config, ["head"]) == {"redis", "metaserver", "router"}  # off unless asked


def test_every_data_server_keeps_an_aof_fsynced_every_second_and_can_serve_as_replica() -> None:
    services = _head(HA_ENV)["services"]
    for name in ("redis", "redis-replica"):
        command = " ".join(services[name]["command"])
        assert "--appendonly yes --appendfsync everysec" in command, name
        assert f"--replica-announce-ip {name}" in command and "--masterauth" in command, name
    assert "--replicaof redis 6379" in " ".join(services["redis-replica"]["command"])


def test_sentinels_watch_the_master_the_metaserver_asks_for() -> None:
    services = _head(HA_ENV)["services"]
    store = parse_store_url(services["metaserver"]["environment"]["PDGATE_METASERVER_STORE"])
    assert (store.mode, store.service, store.options.get("password")) == ("sentinel", "pdgate", "pw1")
    assert store.nodes == (("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379))
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        svc = services[name]
        command = " ".join(svc["command"])
        assert "sentinel monitor pdgate redis 6379 2" in command  # quorum 2 of 3
        assert svc["environment"]["SENTINEL_NAME"] == name
        assert svc["volumes"][0].startswith(f"{name}-data:/data")
        assert svc["restart"] == "unless-stopped" and svc["healthcheck"]["test"][0] == "CMD-SHELL"


def test_without_ha_the_metaserver_still_uses_the_one_redis() -> None:
    store = _head({"PDGATE_REDIS_PASSWORD": "pw1"})["services"]["metaserver"]["environment"]["PDGATE_METASERVER_STORE"]
    assert store == "redis://:pw1@redis:6379/0"

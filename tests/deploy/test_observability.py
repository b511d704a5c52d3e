"""Prometheus and Grafana provisioning match the services and the metrics the code really exports.

A dashboard query on a metric nobody exports draws an empty panel forever; these tests compare every
`pdgate_*` name in the dashboard and in deploy/README.md with the registries of `pdgate.router.metrics` and
`pdgate.metaserver.metrics`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pdgate.metaserver.metrics import MetaMetrics
from pdgate.router.metrics import RouterMetrics
from prometheus_client import CollectorRegistry

from tests.deploy.support import ENV_FILES, REPO, render

COMPOSE_DIR = REPO / "deploy" / "compose"
DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "pdgate.json"
METRIC_RE = re.compile(r"\bpdgate_[a-z0-9_]*[a-z0-9]\b")  # not the "pdgate_router_*" prefixes


def _exported(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Metric family -> every series name it exposes (counter: _total; histogram: _bucket/_sum/_count)."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        name = family.name
        if family.type == "counter":
            out[name] = {f"{name}_total"}
        elif family.type == "histogram":
            out[name] = {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            out[name] = {name}
    return out


@pytest.fixture(scope="module")
def families() -> dict[str, set[str]]:
    return _exported(RouterMetrics().registry) | _exported(MetaMetrics().registry)


@pytest.fixture(scope="module")
def series(families: dict[str, set[str]]) -> set[str]:
    return set().union(*families.values())


@pytest.fixture(scope="module")
def head() -> dict[str, Any]:
    return render(ENV_FILES["head"])["services"]


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_series(series: set[str]) -> None:
    used = {m for expr in _dashboard_exprs() for m in METRIC_RE.findall(expr)}
    assert used, "the dashboard queries no pdgate metric"
    assert used <= series, sorted(used - series)


def test_dashboard_covers_what_the_readme_promises(families: dict[str, set[str]]) -> None:
    """Request rate, errors by type, phase latencies, handoffs by state, instance load."""
    exprs = "\n".join(_dashboard_exprs())
    assert "pdgate_router_requests_total" in exprs
    assert re.search(r"by \(code\) \(rate\(pdgate_router_errors_total", exprs)
    for phase in ("overhead", "handoff", "prefill", "decode_ttft", "e2e"):
        assert f"histogram_quantile(0.95, sum by (le) (rate(pdgate_router_{phase}_seconds_bucket" in exprs
    assert re.search(r"by \(to_state\) \(rate\(pdgate_metaserver_handoff_transitions_total", exprs)
    assert "pdgate_router_instance_inflight" in exprs


def test_dashboard_panels_use_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == ds["uid"]
        assert all(t["datasource"]["uid"] == ds["uid"] for t in panel["targets"])
    assert ds["url"] == "http://prometheus:9090"


def test_readme_documents_every_metric(families: dict[str, set[str]]) -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    documented = set(METRIC_RE.findall(readme))
    missing = [name for name, names in families.items() if not names & documented and name not in documented]
    assert not missing, f"deploy/README.md does not describe {missing}"
    every = set().union(*families.values()) | set(families)
    assert documented <= every, sorted(documented - every)


def test_prometheus_scrapes_the_head_services_where_they_listen(head: dict[str, Any]) -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    router_port = head["router"]["environment"]["PDGATE_ROUTER_PORT"]
    meta_port = head["metaserver"]["environment"]["PDGATE_METASERVER_PORT"]
    assert jobs["pdgate-router"]["static_configs"][0]["targets"] == [f"router:{router_port}"]
    assert jobs["pdgate-metaserver"]["static_configs"][0]["targets"] == [f"metaserver:{meta_port}"]
    # Extra hosts come from files in the mounted folder; the examples parse as file_sd target lists.
    mounts = {v.split(":")[1]: Path(v.split(":")[0]) for v in head["prometheus"]["volumes"] if ":" in v}
    assert mounts["/etc/prometheus"] == COMPOSE_DIR / "prometheus"
    for job in jobs.values():
        for sd in job.get("file_sd_configs", []):
            assert all(f.startswith("/etc/prometheus/targets/") for f in sd["files"])
    for example in (COMPOSE_DIR / "prometheus/targets").glob("*.example"):
        groups = yaml.safe_load(example.read_text())
        assert all(isinstance(g["targets"], list) for g in groups)


def test_grafana_reads_the_provisioned_dashboard(head: dict[str, Any]) -> None:
    grafana = head["grafana"]
    mounts = {v.split(":")[1]: Path(v.split(":")[0]) for v in grafana["volumes"] if v.startswith("/")}
    provider = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/dashboards/pdgate.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == COMPOSE_DIR / "grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD.name}"

"""The connector's counters as vLLM KV-connector stats, and as Prometheus counters on vLLM's /metrics.

The scheduler half owns the counters (`pdgate.connector.counters.COUNTERS`; workers send their pull outcomes
to it). Each engine step it hands vLLM the increments since the last step (`PDGateStats`); vLLM ships
them to the API server, which logs them ("KV Transfer metrics: ...") and calls
`PDGatePromMetrics.observe`, so every counter appears on the server's `/metrics` as
`pdgate_connector_<name>_total{model_name=..., engine=...}`. The same totals are also written to
`stats_file` (when configured) by the control thread, for observers that prefer a JSON file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdgate.connector.counters import COUNTERS
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["METRIC_PREFIX", "PDGatePromMetrics", "PDGateStats"]

METRIC_PREFIX = "pdgate_connector_"


@dataclass
class PDGateStats(KVConnectorStats):
    """Counter increments (`data`: counter name -> int) over one interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PDGatePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter, labelled per engine like vLLM's own metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in COUNTERS.items():
            metric = self._counter_cls(
                name=f"{METRIC_PREFIX}{name}", documentation=documentation, labelnames=labelnames
            )
            self._counters[name] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is None or not isinstance(value, (int, float)) or value <= 0:
                continue
            counter = per_engine.get(engine_idx)
            if counter is not None:
                counter.inc(value)

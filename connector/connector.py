"""`PDGateConnector`: the vLLM v1 KV connector facade. It builds one half by role and delegates.

* SCHEDULER role (engine-core process): `SchedulerHalf` (pure bookkeeping) + `ControlThread`
  (metaserver I/O on a thread of its own; with `control_process: true`, the same thread in a child
  process, `ControlProcess`, so ledger calls never wait on the engine's GIL. Not the default yet: in one
  full e2e run under 64-stream load both engines' child processes went silent for ~90 s, their
  heartbeats lapsed and the router lost its pair; the thread never did). This facade moves commands
  from the first to the second and results back, at the hooks vLLM calls every step
  (`build_connector_meta`, `update_connector_output`, ...).
* WORKER role (one per worker process / TP rank): `WorkerHalf`, which owns the transport thread.

The halves share no objects: the scheduler half reaches the workers only through the per-step
`PDGateConnectorMetadata`, the workers reach it only through `PDGateWorkerMeta` (pull outcomes) and
vLLM's finished-sending/receiving sets, and each worker's transport address reaches it once through
vLLM's handshake metadata (`get_handshake_metadata` -> `set_xfer_handshake_metadata`).

Loaded without patching vLLM, either as
`{"kv_connector": "PDGateConnector", "kv_connector_module_path": "pdgate.connector", ...}` or, once pdgate is
installed, as plain `{"kv_connector": "PDGateConnector"}` through the `vllm.general_plugins` entry point
(`pdgate.connector.plugin:register`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdgate.connector.config import ConnectorConfig, ServerFacts, discover_server, parse_config
from pdgate.connector.control import ControlThread
from pdgate.connector.control_process import ControlProcess
from pdgate.connector.errors import ConfigError
from pdgate.connector.location import EngineFacts
from pdgate.connector.logs import setup_logging
from pdgate.connector.messages import FeedStatus, Register
from pdgate.connector.metadata import PullOutcome, StepMetadata
from pdgate.connector.registration import build_registration, kv_layout_tag
from pdgate.connector.scheduler import SchedulerHalf, idle_step
from pdgate.connector.stats import PDGatePromMetrics, PDGateStats
from pdgate.connector.transport.factory import make_transport
from pdgate.connector.worker import WorkerHalf
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

try:  # a vLLM metrics label for where our cache hits come from (not every vLLM release has it)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P_SOURCE: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover
    _P2P_SOURCE = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDGateConnector", "PDGateConnectorMetadata", "PDGateHandshake", "PDGateWorkerMeta"]

logger = logging.getLogger(__name__)


@dataclass
class PDGateConnectorMetadata(KVConnectorMetadata):
    step: StepMetadata


@dataclass
class PDGateHandshake(KVConnectorHandshakeMetadata):
    tp_rank: int
    address: dict[str, Any]


@dataclass
class PDGateWorkerMeta(KVConnectorWorkerMetadata):
    outcomes: list[PullOutcome] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PDGateWorkerMeta):
            self.outcomes.extend(other.outcomes)
        return self


def server_facts(
    vllm_config: VllmConfig, argv: list[str] | None = None, env: dict[str, str] | None = None
) -> ServerFacts:
    """What the config defaults depend on, read from vLLM and the process (see `discover_server`)."""
    kv = vllm_config.kv_transfer_config
    host, port = discover_server(sys.argv if argv is None else argv, os.environ if env is None else env)
    if host is None and port is not None:
        host = _outbound_ip()
    served = vllm_config.model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return ServerFacts(
        kv_role=(kv.kv_role or "") if kv is not None else "",
        dp_rank=vllm_config.parallel_config.data_parallel_rank,
        dp_size=vllm_config.parallel_config.data_parallel_size,
        host=host,
        port=port,
        served_model=served or vllm_config.model_config.model,
    )


def _outbound_ip() -> str:
    """The address a server bound to every interface (`vllm serve` without `--host`) is reached at:
    vLLM's own rule for what it advertises (`VLLM_HOST_IP`, else the interface of the default route).
    A host with no route at all (loopback only) answers on 127.0.0.1, which is what a router on the
    same host calls; set `kv_connector_extra_config.url` for anything else."""
    from vllm.utils.network_utils import get_ip

    with warnings.catch_warnings():  # get_ip warns before answering 0.0.0.0: the fallback below is ours
        warnings.simplefilter("ignore")
        ip = get_ip()
    if ip in ("0.0.0.0", "::"):
        logger.warning("no default route on this host: registering 127.0.0.1 (set kv_connector_extra_config.url)")
        return "127.0.0.1"
    return ip


def _kv_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> tuple[int, str, str]:
    """(block_size, kv_dtype, kv_layout tag) of this engine."""
    block_size = vllm_config.cache_config.block_size
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default"
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto":
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    heads = head = layers = 0
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        block_size = getattr(spec, "block_size", block_size)
        heads = getattr(spec, "num_kv_heads", 0)
        head = getattr(spec, "head_size", 0)
        layers = len(group.layer_names)
    tag = kv_layout_tag(
        layout=str(layout), dtype=dtype, num_kv_heads=heads, head_size=head, block_size=block_size, num_layers=layers
    )
    return block_size, dtype, tag


class PDGateConnector(KVConnectorBase_V1):
    """pdgate's PD-disaggregation connector; see the module docstring, then `scheduler.py` and `worker.py`.

    `has_pending_block_frees` is left False on purpose: a held prefill may wait up to a handoff lease for
    its decode, and stalling the whole batch that long is worse than vLLM's usual preemption.
    """

    _cache_hit_source = _P2P_SOURCE if _P2P_SOURCE is not None else KVConnectorBase_V1._cache_hit_source

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        kv = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("PDGateConnector does not support pipeline parallelism (pipeline_parallel_size > 1)")
        self._cfg: ConnectorConfig = parse_config(kv.kv_connector_extra_config, server_facts(vllm_config), os.environ)
        setup_logging(self._cfg.log_level)
        self._sched: SchedulerHalf | None = None
        self._control: ControlThread | ControlProcess | None = None
        self._worker: WorkerHalf | None = None
        self._published_version = -1
        self._dp_size = parallel.data_parallel_size
        self._published_load: tuple[int, int, float] | None = None
        self._stats_seen: dict[str, int] = {}
        block_size, kv_dtype, kv_layout = _kv_facts(vllm_config, kv_cache_config)
        # Everything the registry record needs but the workers' addresses, which arrive with the handshake.
        self._registration = functools.partial(
            build_registration,
            self._cfg,
            dp_rank=parallel.data_parallel_rank,
            dp_size=parallel.data_parallel_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            block_size=block_size,
            kv_dtype=kv_dtype,
            kv_layout=kv_layout,
            kv_replicated=bool(vllm_config.model_config.use_mla),
            engine_id=kv.engine_id,
        )
        if role == KVConnectorRole.SCHEDULER:
            facts = EngineFacts(
                instance_id=self._cfg.instance_id,
                engine_id=kv.engine_id,
                host=_url_host(self._cfg.url),
                dp_rank=parallel.data_parallel_rank,
                tp_size=parallel.tensor_parallel_size,
                world_size=parallel.world_size,
                block_size=block_size,
                kv_dtype=kv_dtype,
                kv_layout=kv_layout,
                kv_replicated=bool(vllm_config.model_config.use_mla),
                transport=self._cfg.transport,
            )
            self._sched = SchedulerHalf(self._cfg, facts)
            # The control thread; in a child process (off the engine's GIL) when the config asks for it.
            self._control = ControlProcess(self._cfg) if self._cfg.control_process else ControlThread(self._cfg)
            logger.info(
                "PDGateConnector scheduler half: instance %s (%s), metaserver %s",
                self._cfg.instance_id,
                self._cfg.role,
                self._cfg.metaserver_url,
            )
        else:
            tp_rank = _tp_rank()
            cfg = self._cfg
            dp_rank = parallel.data_parallel_rank
            tp_size = parallel.tensor_parallel_size
            # The factory runs on the transfer thread once the KV caches are registered, so it can read
            # which device they are on (`worker.device_index`; llm_datadist initialises there).
            worker = WorkerHalf(
                cfg,
                tp_rank=tp_rank,
                transport_factory=lambda: make_transport(
                    cfg, tp_rank=tp_rank, dp_rank=dp_rank, tp_size=tp_size, device_index=worker.device_index
                ),
                block_size=block_size,
            )
            self._worker = worker

    # ==== worker side ================================================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.address is None:
            return None
        return PDGateHandshake(self._worker.tp_rank, dict(self._worker.address))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PDGateConnectorMetadata):
            self._worker.on_step(meta.step)  # every step: an empty one still says whether it is idle

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)  # a layer-wise load (`layerwise.py`); else at once

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull design: the decode reads the prefill's blocks where they are

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_layered()  # no layer-wise read outlives the step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        outcomes = self._worker.take_outcomes(drain=False)  # get_finished, just before, drained them
        return PDGateWorkerMeta(outcomes) if outcomes else None

    # ==== scheduler side =============================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens, now=time.monotonic())
        self._flush()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None and self._control is not None
        now = time.monotonic()
        self._pump(now)
        idle = idle_step(scheduler_output.total_num_scheduled_tokens, self._dp_size)
        step = self._sched.build(scheduler_output.finished_req_ids, now=now, idle=idle)
        self._flush()  # the ledger calls first: a load report is never on a request's path
        self._publish()
        return PDGateConnectorMetadata(step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PDGateWorkerMeta) and meta.outcomes:
            self._sched.on_worker_output(meta.outcomes, now=time.monotonic())
            self._flush()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        result = self._sched.request_finished(request, block_ids, now=time.monotonic())
        self._flush()  # READY first: the router's claim waits for it
        self._publish()  # the engine may go idle right after its last request: publish the final load now
        return result

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None and self._control is not None
        addresses = {rank: m.address for rank, m in metadata.items() if isinstance(m, PDGateHandshake)}
        models = self._sched.set_addresses(addresses)
        registration = self._registration(addresses=models)
        self._control.submit([Register(registration)])

    def get_kv_connector_stats(self) -> PDGateStats | None:
        if self._sched is None:
            return None
        counters = self._sched.counters
        delta = {k: v - self._stats_seen.get(k, 0) for k, v in counters.items() if v != self._stats_seen.get(k, 0)}
        if not delta:
            return None
        self._stats_seen = dict(counters)
        return PDGateStats(data=delta)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._control is not None and self._sched is not None:
            self._control.publish_stats(self._sched.snapshot())  # close() writes it: the last one is kept
            self._control.close(abort_transfer_ids=self._sched.held_transfer_ids())
            self._control = None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDGateStats | None:
        return PDGateStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDGatePromMetrics:
        return PDGatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== glue =======================================================================================

    def _pump(self, now: float) -> None:
        assert self._sched is not None and self._control is not None
        for result in self._control.drain():
            self._sched.on_result(result, now=now)
        feed_at = self._control.feed_ok_at
        if feed_at is not None:
            self._sched.on_result(FeedStatus(True, feed_at), now=now)

    def _flush(self) -> None:
        assert self._sched is not None and self._control is not None
        commands = self._sched.take_commands()
        if commands:
            self._control.submit(commands)

    def _publish(self) -> None:
        """Leave the control thread the current load and counters when they changed (no I/O, no wake-up:
        it reads them when it heartbeats or writes the stats file). Runs at every step: the load's
        figures are compared before a model of them is built."""
        assert self._sched is not None and self._control is not None
        usage = self._kv_cache_manager.usage if self._kv_cache_manager is not None else 0.0
        running, waiting = self._sched.load_figures()
        key = (running, waiting, round(usage, 3))
        if key != self._published_load:
            self._published_load = key
            self._control.publish_load(self._sched.load(usage))
        if self._cfg.stats_file and self._sched.counters_version != self._published_version:
            # The control thread coalesces these and writes the file at most every few hundred ms.
            self._published_version = self._sched.counters_version
            self._control.publish_stats(self._sched.snapshot())


def _tp_rank() -> int:
    try:
        from vllm.distributed import parallel_state

        initialized: Callable[[], bool] = parallel_state.model_parallel_is_initialized
        get_tensor_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank
        if initialized():
            return int(get_tensor_model_parallel_rank())
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        logger.debug("TP rank unavailable (%r); assuming 0", exc)
    return 0


def _url_host(url: str) -> str | None:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest

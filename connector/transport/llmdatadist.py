"""CANN ``llm_datadist`` transport in CacheManager mode: the Ascend path.

Written against CANN's documented ``llm_datadist`` Python API (the CacheManager interface that
vllm-ascend's ``LLMDataDistCMgrConnector`` also uses) so it runs unchanged on Ascend; tests drive it
with ``tests/fakes/fake_llmdatadist.py`` passed as ``llm_datadist=``.

Shape of the calls:

* ``LLMDataDist(LLMRole.PROMPT|DECODER, cluster_id)``; one cluster per NPU device, the id
  coming from the global rank table (``pdgate.connector.ranktable``) when there is one, else derived from
  the device IP (``pdgate.connector.devices``; the decode learns the prefill's from its registry address).
* ``LLMConfig``: ``device_id`` (as this process sees it: ``visible_device_id``), ``sync_kv_timeout``
  (the engine-side deadline of every ``pull_blocks``), ``enable_cache_manager=True``,
  ``enable_remote_cache_accessible=True``,
  and ``listen_ip_info="<device_ip>:<port>"`` on the side that is pulled from.
  ``init(config.generate_options())``, then ``cache_manager``.
* :meth:`register`: regions are grouped by ``block_len``; each group becomes one
  ``register_blocks_cache(CacheDesc(n, [num_blocks, block_len], DT_INT8), addrs,
  BlocksCacheKey(cluster_id, model_id=<group index>))``. Blocks are opaque bytes, so no torch
  dtype is needed (and no torch/torch_npu import on this path).
* Links are built lazily, per remote cluster, with ``link_clusters([LLMClusterInfo], timeout)``
  (device IP + port on both ends); they return status codes rather than raise.
* :meth:`start_pull` queues the pull on ONE worker thread (``pull_blocks`` blocks, and link
  calls are serialised by the library anyway); results come back through a queue that
  :meth:`poll` drains. Only that thread touches links after construction.
* A pull that times out (``LLM_WAIT_PROCESS_TIMEOUT``/``LLM_TIMEOUT``) leaves the link
  "unrecoverable and must be re-established" (CANN's words): we unlink it and the next pull
  to that cluster links again. Any other link-class failure does the same.

Keys: in CacheManager mode blocks are addressed by ``BlocksCacheKey(remote cluster_id,
model_id)`` plus block ids; there is no per-request cache key. The request's ``kv_key`` (the
ledger's numeric key) is validated as uint64 and logged; it is never derived by hashing a string.

Deadlines: the engine enforces ``sync_kv_timeout`` per ``pull_blocks``. We never report a
failure while a ``pull_blocks`` may still be writing, so ``PullRequest.timeout_s`` only fails
requests that waited in the queue past their deadline without starting.

Address exported by :meth:`LLMDataDistTransport.local_address`::

    {"kind": "llmdatadist", "cluster_id": int, "device_id": int, "device_ip": str,
     "listen_port": int | None, "server_id": str | None, "super_device_id": int | None,
     "super_pod_id": str | None, "regions": [...]}
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pdgate.connector.transport.base import (
    UINT64_MAX,
    KVRegion,
    PullRequest,
    PullResult,
    RemotePeer,
    Transport,
    drain,
    regions_from_address,
)
from pdgate.connector.transport.errors import (
    EngineError,
    InvalidPull,
    LinkError,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    RemoteKVMissing,
    TransportError,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LISTEN_PORT",
    "MAX_CLUSTERS_PER_LINK_CALL",
    "MAX_REGISTERED_ADDRS",
    "LLMDataDistTransport",
    "group_regions",
    "map_status",
]

#: link_clusters accepts at most 16 clusters per call; more returns LLM_CLUSTER_NUM_EXCEED_LIMIT
#: (CANN's link limits).
MAX_CLUSTERS_PER_LINK_CALL = 16
#: register_cache + register_blocks_cache together may hold at most 240 addresses per process
#: (256 in CANN 8.0's documentation; we use the stricter current figure).
MAX_REGISTERED_ADDRS = 240
#: HCCS needs page-aligned registered memory; CANN recommends 2 MB alignment.
RECOMMENDED_ALIGNMENT = 2 * 1024 * 1024
#: Listen port on the device IP; vllm-ascend's llm_datadist connectors listen on 26000 too.
DEFAULT_LISTEN_PORT = 26000
DEFAULT_SYNC_KV_TIMEOUT_MS = 10_000
DEFAULT_LINK_TIMEOUT_MS = 10_000

# Status name -> error class. Names, not numbers: the numeric values differ between CANN
# releases and the Python enum is what the library raises.
_STATUS_ERRORS: dict[str, type[TransportError]] = {
    "LLM_WAIT_PROCESS_TIMEOUT": PullTimeout,
    "LLM_TIMEOUT": PullTimeout,
    "LLM_KV_CACHE_NOT_EXIST": RemoteKVMissing,
    "LLM_PARAM_INVALID": InvalidPull,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": InvalidPull,
    "LLM_NOT_YET_LINK": LinkError,
    "LLM_LINK_FAILED": LinkError,
    "LLM_UNLINK_FAILED": LinkError,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": LinkError,
    "LLM_PROCESSING_LINK": LinkError,
    "LLM_LINK_BUSY": LinkError,
    "LLM_EXIST_LINK": LinkError,
    "LLM_SUSPECT_REMOTE_ERROR": PeerUnreachable,
}
#: Failures after which the link to that cluster is torn down and rebuilt on the next pull.
_BREAKS_LINK = (PullTimeout, LinkError, PeerUnreachable)


def map_status(status: object, message: str) -> TransportError:
    """Typed error for an ``LLMStatusCode`` (or anything with a ``.name``); unknown -> EngineError."""
    name = getattr(status, "name", None) or str(status)
    return _STATUS_ERRORS.get(name, EngineError)(message, engine_code=name)


def group_regions(regions: Sequence[KVRegion]) -> list[list[int]]:
    """Region indices grouped by ``block_len`` in first-seen order; group i is ``model_id`` i.

    One ``CacheDesc`` describes tensors of one shape, so each group is one registration. Both
    sides run this on layouts that ``check_layouts_match`` already proved identical in names and
    block sizes, so their model ids agree without being exchanged.
    """
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(regions):
        groups.setdefault(r.block_len, []).append(i)
    return list(groups.values())


def _ipv4(value: object, what: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise InvalidPull(f"{what} must be an IPv4 address, got {value!r}") from None


@dataclass(frozen=True)
class _Remote:
    cluster_id: int
    device_ip: str
    listen_port: int
    regions: tuple[KVRegion, ...]


class LLMDataDistTransport(Transport):
    """Pull KV blocks between Ascend devices with llm_datadist. See the module docstring."""

    kind = "llmdatadist"

    def __init__(
        self,
        *,
        role: str,
        cluster_id: int,
        device_id: int,
        device_ip: str,
        visible_device_id: int | None = None,
        listen_port: int | None = None,
        server_id: str | None = None,
        super_device_id: int | None = None,
        super_pod_id: str | None = None,
        sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS,
        link_timeout_ms: int = DEFAULT_LINK_TIMEOUT_MS,
        host_memory: bool = False,
        clock: Callable[[], float] = time.monotonic,
        llm_datadist: ModuleType | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if not 0 <= cluster_id <= UINT64_MAX:
            raise ValueError("cluster_id must fit in uint64")
        # Lazy: only Ascend hosts have it (CANN toolkit, not PyPI); tests pass the fake module.
        self._lib: Any = llm_datadist if llm_datadist is not None else importlib.import_module("llm_datadist")
        self.role = role
        self.cluster_id = cluster_id
        self.device_id = device_id
        # LLMConfig wants the device as this process sees it; with ASCEND_RT_VISIBLE_DEVICES that differs
        # from the host-level id peers and operators know it by (which is what local_address publishes).
        self.visible_device_id = device_id if visible_device_id is None else visible_device_id
        self.device_ip = _ipv4(device_ip, "device_ip")
        self.listen_port = (
            listen_port if listen_port is not None else (DEFAULT_LISTEN_PORT if role == "prefill" else None)
        )
        self.server_id = server_id
        self.super_device_id = super_device_id
        self.super_pod_id = super_pod_id
        self._link_timeout_ms = link_timeout_ms
        self._host_memory = host_memory
        self._clock = clock

        lib = self._lib
        config = lib.LLMConfig()
        config.device_id = self.visible_device_id
        config.sync_kv_timeout = sync_kv_timeout_ms
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        if self.listen_port is not None:
            config.listen_ip_info = f"{self.device_ip}:{self.listen_port}"
        llm_role = lib.LLMRole.PROMPT if role == "prefill" else lib.LLMRole.DECODER
        try:
            self._dd = lib.LLMDataDist(llm_role, cluster_id)
            self._dd.init(config.generate_options())
            self._cm = self._dd.cache_manager
        except lib.LLMException as exc:
            raise map_status(exc.status_code, f"llm_datadist init failed: {exc}") from exc

        self._caches: list[Any] = []  # index = model_id
        self._links: dict[int, Any] = {}  # remote cluster id -> LLMClusterInfo; worker thread only
        self._results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._pending_lock = threading.Lock()
        # One thread: pull_blocks blocks, link calls are serialised by the library, and a single
        # owner keeps the link table free of locks.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pdgate-llmdd-{cluster_id}")
        logger.info(
            "llm_datadist cluster %d (%s, device %d, %s) initialised", cluster_id, role, device_id, self.device_ip
        )

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._check_registration(regions)
        if len(regions) > MAX_REGISTERED_ADDRS:
            raise RegistrationError(
                f"{len(regions)} regions exceed llm_datadist's limit of {MAX_REGISTERED_ADDRS} registered addresses"
            )
        for r in regions:
            if not r.is_dense:
                raise RegistrationError(
                    f"region {r.name!r} has stride {r.stride} != block_len {r.block_len}; llm_datadist "
                    "describes each address as one [num_blocks, block_len] tensor"
                )
            if r.base_ptr % RECOMMENDED_ALIGNMENT:
                logger.warning("region %s at %#x is not 2 MiB aligned; HCCS links may fail", r.name, r.base_ptr)
        lib = self._lib
        placement = lib.Placement.HOST if self._host_memory else lib.Placement.DEVICE
        caches = []
        for model_id, members in enumerate(group_regions(regions)):
            group = [regions[i] for i in members]
            if len({r.num_blocks for r in group}) != 1:
                raise RegistrationError(f"regions {[r.name for r in group]} share block_len but not num_blocks")
            desc = lib.CacheDesc(len(group), [group[0].num_blocks, group[0].block_len], lib.DataType.DT_INT8, placement)
            key = lib.BlocksCacheKey(cluster_id=self.cluster_id, model_id=model_id)
            try:
                caches.append(self._cm.register_blocks_cache(desc, [r.base_ptr for r in group], key))
            except lib.LLMException as exc:
                err = map_status(exc.status_code, f"register_blocks_cache (model_id {model_id}) failed: {exc}")
                raise RegistrationError(err.message, engine_code=err.engine_code) from exc
        self._regions = tuple(regions)
        self._caches = caches
        logger.info(
            "llm_datadist cluster %d registered %d regions as %d caches", self.cluster_id, len(regions), len(caches)
        )

    def _address(self) -> dict[str, Any]:
        return {
            "cluster_id": self.cluster_id,
            "device_id": self.device_id,
            "device_ip": self.device_ip,
            "listen_port": self.listen_port,
            "server_id": self.server_id,
            "super_device_id": self.super_device_id,
            "super_pod_id": self.super_pod_id,
        }

    # ------------------------------------------------------------------ pulls

    def start_pull(self, req: PullRequest) -> None:
        remote = self._parse_remote(req.remote, self._admit_pull(req))
        if req.regions is not None:
            raise InvalidPull("llm_datadist pulls a request's whole cache; it cannot pull some regions only")
        with self._pending_lock:
            if req.transfer_id in self._pending:
                raise InvalidPull(f"transfer {req.transfer_id!r} is already in flight")
            self._pending.add(req.transfer_id)
        submitted = self._clock()
        future = self._worker.submit(self._run_pull, req, remote, submitted)
        future.add_done_callback(self._deliver)

    def prelink(self, peers: Sequence[RemotePeer]) -> Future[dict[int, TransportError | None]]:
        """Link to many prefill ranks ahead of traffic, at most 16 clusters per library call.

        Runs on the worker thread; the future maps each cluster id to None (linked) or its error.
        """
        self._ensure_open()
        remotes = [self._parse_remote(p) for p in peers]
        return self._worker.submit(self._link_many, remotes)

    def poll(self) -> list[PullResult]:
        return drain(self._results, self._closed)

    def _close_engine(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        # The worker has exited: this thread now owns the link table.
        self._unlink(list(self._links))
        for cache in self._caches:
            try:
                self._cm.unregister_cache(cache.cache_id)
            except Exception as exc:
                logger.warning("llm_datadist unregister_cache(%s) failed: %r", cache.cache_id, exc)
        try:
            self._dd.finalize()
        except Exception as exc:
            logger.warning("llm_datadist finalize failed: %r", exc)
        logger.info("llm_datadist cluster %d closed", self.cluster_id)

    # ------------------------------------------------------------------ worker thread

    def _run_pull(self, req: PullRequest, remote: _Remote, submitted: float) -> PullResult:
        started = self._clock()
        if req.timeout_s is not None and started - submitted > req.timeout_s:
            late = PullTimeout(f"pull {req.transfer_id} waited {started - submitted:.3f}s in the queue; not started")
            return PullResult.failure(req.transfer_id, late, elapsed_s=started - submitted)
        lib = self._lib
        try:
            self._ensure_link(remote)
            src, dst = list(req.remote_block_ids), list(req.local_block_ids)
            for model_id, cache in enumerate(self._caches):
                key = lib.BlocksCacheKey(cluster_id=remote.cluster_id, model_id=model_id)
                self._cm.pull_blocks(key, cache, src_blocks=src, dst_blocks=dst)
        except TransportError as link_err:
            return self._failed(req, remote, link_err, submitted)
        except lib.LLMException as exc:
            err = map_status(exc.status_code, f"pull_blocks from cluster {remote.cluster_id}: {exc}")
            return self._failed(req, remote, err, submitted)
        except Exception as exc:  # a bug or an undocumented failure: still a typed result
            return self._failed(req, remote, EngineError(f"pull_blocks raised {exc!r}"), submitted)
        elapsed = self._clock() - submitted
        nbytes = len(req.local_block_ids) * sum(r.block_len for r in self._regions)
        logger.debug("pull %s (kv_key %d) from cluster %d done", req.transfer_id, req.kv_key, remote.cluster_id)
        return PullResult.success(req.transfer_id, nbytes=nbytes, elapsed_s=elapsed)

    def _failed(self, req: PullRequest, remote: _Remote, err: TransportError, submitted: float) -> PullResult:
        logger.warning(
            "pull %s (kv_key %d) from cluster %d failed: %s", req.transfer_id, req.kv_key, remote.cluster_id, err
        )
        if isinstance(err, _BREAKS_LINK) and remote.cluster_id in self._links:
            self._unlink([remote.cluster_id])
        return PullResult.failure(req.transfer_id, err, elapsed_s=self._clock() - submitted)

    def _deliver(self, future: Future[PullResult]) -> None:
        if future.cancelled():  # close() dropped it before it started
            return
        try:
            result = future.result()
        except Exception:  # _run_pull returns every failure as a result; this is a bug guard
            logger.exception("llm_datadist pull worker raised")
            return
        with self._pending_lock:
            self._pending.discard(result.transfer_id)
        self._results.put(result)

    def _cluster_info(self, remote: _Remote) -> Any:
        info = self._lib.LLMClusterInfo()
        info.remote_cluster_id = remote.cluster_id
        info.append_local_ip_info(self.device_ip, 0)
        info.append_remote_ip_info(remote.device_ip, remote.listen_port)
        return info

    def _ensure_link(self, remote: _Remote) -> None:
        if remote.cluster_id in self._links:
            return
        errors = self._link_many([remote])
        err = errors[remote.cluster_id]
        if err is not None:
            raise err

    def _link_many(self, remotes: Sequence[_Remote]) -> dict[int, TransportError | None]:
        lib = self._lib
        out: dict[int, TransportError | None] = {}
        todo = [r for r in {r.cluster_id: r for r in remotes}.values() if r.cluster_id not in self._links]
        out.update({r.cluster_id: None for r in remotes if r.cluster_id in self._links})
        for start in range(0, len(todo), MAX_CLUSTERS_PER_LINK_CALL):
            chunk = todo[start : start + MAX_CLUSTERS_PER_LINK_CALL]
            infos = [self._cluster_info(r) for r in chunk]
            try:
                ret, rets = self._dd.link_clusters(infos, timeout=self._link_timeout_ms)
            except lib.LLMException as exc:
                err = map_status(exc.status_code, f"link_clusters failed: {exc}")
                out.update({r.cluster_id: err for r in chunk})
                continue
            if len(rets) != len(chunk):  # call-level failure such as LLM_CLUSTER_NUM_EXCEED_LIMIT
                err = map_status(ret, f"link_clusters rejected the call for {len(chunk)} clusters")
                out.update({r.cluster_id: err for r in chunk})
                continue
            for r, info, status in zip(chunk, infos, rets, strict=True):
                name = getattr(status, "name", str(status))
                if name in ("LLM_SUCCESS", "LLM_ALREADY_LINK"):
                    self._links[r.cluster_id] = info
                    out[r.cluster_id] = None
                    logger.info(
                        "cluster %d linked to %d (%s:%d)", self.cluster_id, r.cluster_id, r.device_ip, r.listen_port
                    )
                else:
                    err = map_status(status, f"link to cluster {r.cluster_id} at {r.device_ip}:{r.listen_port} failed")
                    out[r.cluster_id] = err if isinstance(err, LinkError) else LinkError(err.message, engine_code=name)
        return out

    def _unlink(self, cluster_ids: Sequence[int]) -> None:
        infos = [self._links.pop(c) for c in cluster_ids if c in self._links]
        for start in range(0, len(infos), MAX_CLUSTERS_PER_LINK_CALL):
            chunk = infos[start : start + MAX_CLUSTERS_PER_LINK_CALL]
            try:
                ret, _ = self._dd.unlink_clusters(chunk, timeout=self._link_timeout_ms, force=True)
                if getattr(ret, "name", ret) != "LLM_SUCCESS":
                    logger.warning("unlink_clusters returned %s; the links are forgotten anyway", ret)
            except Exception as exc:
                logger.warning("unlink_clusters failed (%r); the links are forgotten anyway", exc)

    # ------------------------------------------------------------------ helpers

    def _label(self) -> str:
        return f"llm_datadist transport (cluster {self.cluster_id})"

    def _parse_remote(self, peer: RemotePeer, regions: Sequence[KVRegion] | None = None) -> _Remote:
        """A prefill rank's address; `regions`: its regions, when `_admit_pull` already read them."""
        if regions is None:
            self._check_kind(peer, self.kind)
            regions = regions_from_address(peer)
        cluster_id = peer.get("cluster_id")
        port = peer.get("listen_port")
        if not isinstance(cluster_id, int) or isinstance(cluster_id, bool) or not 0 <= cluster_id <= UINT64_MAX:
            raise InvalidPull(f"peer cluster_id must be a uint64 int, got {cluster_id!r}")
        if cluster_id == self.cluster_id:
            raise InvalidPull(f"peer cluster_id {cluster_id} is our own")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise InvalidPull(f"peer cluster {cluster_id} does not listen (listen_port={port!r})")
        ip = _ipv4(peer.get("device_ip"), f"device_ip of cluster {cluster_id}")
        return _Remote(cluster_id, ip, port, tuple(regions))

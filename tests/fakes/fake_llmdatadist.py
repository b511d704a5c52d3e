"""FAKE ``llm_datadist`` for tests: CANN cannot run on these machines (no Ascend NPU, and the
module ships only inside the CANN toolkit, not on PyPI), so this stands in for it.

It follows the documented Python API of ``llm_datadist`` in CacheManager mode, as summarised in
shared/reference/vllm-connector-api.md section 5 (hiascend "LLM-DataDist API List"; wrapper
source in cann/hixl ``src/python/llm_datadist``): the same class names (LLMDataDist, LLMConfig,
CacheDesc, BlocksCacheKey, Cache, LLMClusterInfo, LLMException, LLMStatusCode, LLMRole,
DataType, Placement, RegisterMemStatus), the same methods and argument order (init,
finalize, cache_manager, link_clusters / unlink_clusters returning ``(status, [status])``,
register_blocks_cache, unregister_cache, pull_blocks) and the status-code names, with the
C++ numeric values where the reference lists them (``LLM_WAIT_PROC_TIMEOUT = 0x5010B001`` ...).

What it does for real: an in-process registry (:data:`WORLD`) of initialised clusters, their
listen addresses, registered block caches and links, so a P and a D ``LLMDataDist`` in one
process can link and ``pull_blocks`` REAL bytes between registered host addresses (ctypes
memmove). Fault injection (:class:`Faults`) covers pull timeouts (which poison the link, as
documented for ``LLM_WAIT_PROCESS_TIMEOUT``), link failures and forced status codes.

Only the CacheManager-mode subset the transport uses is implemented (not the HCCL rank-table
``link()``/``unlink()`` variant, KvCacheManager mode, push or swap). Deliberate deviations, all
fake-only: several LLMDataDist per process (real: one); memory is host memory at any alignment;
a poisoned link answers pulls with ``LLM_LINK_FAILED`` (the real code after a timeout is not
documented); exceeding 240 registered addresses raises ``LLM_PARAM_INVALID`` (the real code is
not documented); a timeout fault does not sleep.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, NoReturn

__all__ = [
    "WORLD",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "DataType",
    "Faults",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LlmConfig",
    "Placement",
    "RegisterMemStatus",
    "reset",
]

#: Documented limits (reference section 5.1 / 5.4 / 5.6).
MAX_CLUSTERS_PER_LINK_CALL = 16
MAX_REGISTERED_ADDRS = 240


class LLMStatusCode(IntEnum):
    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_PARAM_INVALID = 0x5010B005
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    # Documented names whose numeric values the reference does not give (fake-only values).
    LLM_REPEAT_REQUEST = 0x5010BF01
    LLM_PREFIX_ALREADY_EXIST = 0x5010BF02
    LLM_PREFIX_NOT_EXIST = 0x5010BF03
    LLM_DEVICE_MEM_ERROR = 0x5010BF04
    LLM_ENGINE_FINALIZED = 0x5010BF05
    LLM_SUSPECT_REMOTE_ERROR = 0x5010BF06
    LLM_UNKNOWN_ERROR = -1


class LLMException(RuntimeError):
    def __init__(self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


def _raise(code: LLMStatusCode, message: str) -> NoReturn:
    raise LLMException(f"{message} (status {code.name})", status_code=code)


class LLMRole(IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class DataType(Enum):
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_BF16 = 27


_DT_SIZE = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_BF16: 2,
}


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class CacheDesc:
    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        if not isinstance(num_tensors, int) or num_tensors < 0:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "num_tensors must be uint32")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "shape must be a list of int")
        if not isinstance(data_type, DataType):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "data_type must be DataType")
        if not 0 <= batch_dim_index < len(shape):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, f"batch_dim_index {batch_dim_index} out of range")
        self.num_tensors = num_tensors
        self.shape: list[int] = list(shape)
        self.data_type = data_type
        self.placement = placement
        self.batch_dim = batch_dim_index
        self.seq_len_dim_index = seq_len_dim_index
        self.kv_tensor_format = kv_tensor_format

    @property
    def batch_size(self) -> int:
        return self.shape[self.batch_dim]

    @property
    def size(self) -> int:
        n = _DT_SIZE[self.data_type]
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"CacheDesc(num_tensors={self.num_tensors}, shape={self.shape}, data_type={self.data_type})"


class BlocksCacheKey:
    def __init__(self, *args: int, **kwargs: int) -> None:
        if len(args) + len(kwargs) > 2:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "Param num is over limit")
        if args:
            kwargs["cluster_id"] = args[0]
        if len(args) > 1:
            kwargs["model_id"] = args[1]
        if "cluster_id" not in kwargs and "prompt_cluster_id" not in kwargs:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "Param prompt_cluster_id or cluster_id is required")
        for k in kwargs:
            if k not in ("cluster_id", "prompt_cluster_id", "model_id"):
                _raise(LLMStatusCode.LLM_PARAM_INVALID, f"Unsupported param:{k}")
        cluster_id = kwargs.get("cluster_id", kwargs.get("prompt_cluster_id"))
        model_id = kwargs.get("model_id", 0)
        if not isinstance(cluster_id, int) or not isinstance(model_id, int):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "cluster_id and model_id must be int")
        self.cluster_id: int = cluster_id
        self.model_id: int = model_id

    @property
    def prompt_cluster_id(self) -> int:
        return self.cluster_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self.cluster_id}, model_id={self.model_id})"


class CacheKey:
    """KvCacheManager-mode key; accepted by the constructor only (pull_blocks here needs BlocksCacheKey)."""

    def __init__(self, prompt_cluster_id: int, req_id: int, model_id: int = 0) -> None:
        self.prompt_cluster_id = prompt_cluster_id
        self.req_id = req_id
        self.model_id = model_id


class Cache:
    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int], owner: int) -> None:
        self.cache_id = cache_id
        self.cache_desc = cache_desc
        self.tensor_addrs = tensor_addrs
        self.is_blocks_cache = True
        self._owner = owner  # cluster id of the LLMDataDist that registered it

    def __repr__(self) -> str:
        return f"Cache(cache_id = {self.cache_id}, device_tensor_addrs = {len(self.tensor_addrs)})"


def _ip_to_int(ip: str | int) -> int:
    if isinstance(ip, int):
        return ip
    try:
        return int.from_bytes(ipaddress.IPv4Address(ip).packed, "little")
    except ValueError:
        raise RuntimeError(f"Can not parse ip str:{ip}") from None


class LLMClusterInfo:
    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self.remote_role_type: LLMRole | int | None = None
        self.local_ip_info_list: list[tuple[int, int]] = []
        self.remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        if not isinstance(value, int) or not 0 <= value < 2**64:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "remote_cluster_id must be uint64")
        self._remote_cluster_id = value

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        self.local_ip_info_list.append((_ip_to_int(ip), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        self.remote_ip_info_list.append((_ip_to_int(ip), port))


class LLMConfig:
    """Setters with the documented names; ``generate_options`` yields the wrapper's option keys."""

    def __init__(self) -> None:
        self.device_id: int | None = None
        self.sync_kv_timeout: int | str | None = None
        self.enable_switch_role = False
        self.ge_options: dict[str, str] = {}
        self.listen_ip_info = ""
        self.mem_utilization = 0.95
        self.buf_pool_cfg = ""
        self.enable_cache_manager: bool | None = None
        self.mem_pool_cfg = ""
        self.host_mem_pool_cfg = ""
        self.enable_remote_cache_accessible: bool | None = None
        self.rdma_traffic_class: int | None = None
        self.rdma_service_level: int | None = None
        self.local_comm_res: str | None = None
        self.link_total_time: int | None = None
        self.link_retry_count: int | None = None

    def generate_options(self) -> dict[str, str]:
        opts = dict(self.ge_options)
        if self.device_id is not None:
            opts["ge.exec.deviceId"] = str(self.device_id)
        if self.sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self.sync_kv_timeout)
        if self.enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self.enable_cache_manager else "0"
        if self.enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self.enable_remote_cache_accessible else "0"
        if self.listen_ip_info:
            opts["llm.listenIpInfo"] = self.listen_ip_info
        if self.enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        if self.local_comm_res is not None:
            opts["llm.LocalCommRes"] = self.local_comm_res
        opts["llm.MemoryUtilization"] = str(self.mem_utilization)
        return opts


LlmConfig = LLMConfig


# ------------------------------------------------------------------------------------------
# The in-process world
# ------------------------------------------------------------------------------------------


@dataclass
class _Rule:
    code: LLMStatusCode
    times: int


@dataclass
class Faults:
    """Scripted failures, keyed by the REMOTE cluster id of the call they hit."""

    _link: dict[int, _Rule] = field(default_factory=dict)
    _pull: dict[int, _Rule] = field(default_factory=dict)
    #: When set (and not yet signalled), every pull_blocks waits on it: a slow, blocking pull.
    gate: threading.Event | None = None

    def fail_next_link(
        self, remote_cluster_id: int, code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED, times: int = 1
    ) -> None:
        self._link[remote_cluster_id] = _Rule(code, times)

    def timeout_next_pull(self, remote_cluster_id: int, times: int = 1) -> None:
        """The next pull(s) fail with LLM_WAIT_PROCESS_TIMEOUT and poison the link."""
        self._pull[remote_cluster_id] = _Rule(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, times)

    def fail_next_pull(self, remote_cluster_id: int, code: LLMStatusCode, times: int = 1) -> None:
        self._pull[remote_cluster_id] = _Rule(code, times)

    @staticmethod
    def _take(table: dict[int, _Rule], key: int) -> LLMStatusCode | None:
        rule = table.get(key)
        if rule is None:
            return None
        rule.times -= 1
        if rule.times <= 0:
            del table[key]
        return rule.code


@dataclass
class World:
    """Every initialised LLMDataDist in this process, their listeners, caches and links."""

    clusters: dict[int, LLMDataDist] = field(default_factory=dict)
    listeners: dict[tuple[int, int], int] = field(default_factory=dict)
    links: dict[frozenset[int], bool] = field(default_factory=dict)  # pair -> healthy
    faults: Faults = field(default_factory=Faults)
    calls: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, method: str, local: int, remotes: Sequence[int]) -> None:
        self.calls.append((method, local, tuple(remotes)))


WORLD = World()
_ids = itertools.count(1)


def reset() -> None:
    """Forget every cluster, link, fault and recorded call (call between tests)."""
    global WORLD
    WORLD = World()


class CacheManager:
    def __init__(self, dd: LLMDataDist) -> None:
        self._dd = dd
        self.caches: dict[int, tuple[Cache, int | None]] = {}  # cache_id -> (cache, model_id)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        self._dd._check_inited()
        if not isinstance(cache_desc, CacheDesc) or not isinstance(addrs, list) or not addrs:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "cache_desc and a non-empty addrs list are required")
        if len(addrs) != cache_desc.num_tensors or any(not isinstance(a, int) or a == 0 for a in addrs):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "addrs must be num_tensors non-zero ints")
        if self._dd._linked and (remote_accessible or self._dd._remote_accessible):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "you can not register remote accessible cache after link.")
        total = sum(len(c.tensor_addrs) for c, _ in self.caches.values()) + len(addrs)
        if total > MAX_REGISTERED_ADDRS:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, f"registered addresses would be {total} > {MAX_REGISTERED_ADDRS}")
        cache = Cache(next(_ids), cache_desc, list(addrs), self._dd.cluster_id)
        model_id = blocks_cache_key.model_id if blocks_cache_key is not None else None
        self.caches[cache.cache_id] = (cache, model_id)
        return cache

    def unregister_cache(self, cache_id: int) -> None:
        self._dd._check_inited()
        if cache_id not in self.caches:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, f"unknown cache_id {cache_id}")
        del self.caches[cache_id]

    def _by_model(self, model_id: int) -> Cache | None:
        for cache, mid in self.caches.values():
            if mid == model_id:
                return cache
        return None

    def pull_blocks(
        self,
        src_cache_key: BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        **kwargs: Any,
    ) -> None:
        dd = self._dd
        dd._check_inited()
        world = WORLD
        if not isinstance(src_cache_key, BlocksCacheKey):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "fake pull_blocks supports BlocksCacheKey only")
        if not isinstance(dst_cache, Cache) or dst_cache.cache_id not in self.caches:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "dst_cache is not a blocks cache of this LLMDataDist")
        if not dst_blocks or not src_blocks:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "src_blocks and dst_blocks can not be empty.")
        if len(src_blocks) != len(dst_blocks):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "src_blocks and dst_blocks differ in length")
        remote_id = src_cache_key.cluster_id
        world.record("pull_blocks", dd.cluster_id, [remote_id])
        if world.faults.gate is not None and not world.faults.gate.wait(timeout=30):
            _raise(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "[pull_blocks] gate never opened")
        healthy = world.links.get(frozenset((dd.cluster_id, remote_id)))
        if healthy is None:
            _raise(LLMStatusCode.LLM_NOT_YET_LINK, f"cluster {dd.cluster_id} is not linked to {remote_id}")
        if not healthy:
            _raise(LLMStatusCode.LLM_LINK_FAILED, f"link {dd.cluster_id}<->{remote_id} is broken; re-link")
        code = world.faults._take(world.faults._pull, remote_id)
        if code is not None:
            if code in (LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, LLMStatusCode.LLM_TIMEOUT):
                world.links[frozenset((dd.cluster_id, remote_id))] = False
            _raise(code, f"[pull_blocks] injected failure from {remote_id}")
        remote = world.clusters.get(remote_id)
        if remote is None:
            _raise(LLMStatusCode.LLM_LINK_FAILED, f"remote cluster {remote_id} is gone")
        src_cache = remote.cache_manager._by_model(src_cache_key.model_id)
        if src_cache is None:
            _raise(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache {src_cache_key} on cluster {remote_id}")
        sd, dd_desc = src_cache.cache_desc, dst_cache.cache_desc
        block_bytes = sd.size // sd.batch_size
        if sd.num_tensors != dd_desc.num_tensors or block_bytes != dd_desc.size // dd_desc.batch_size:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "src and dst caches differ in tensors or block size")
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            if not 0 <= s < sd.batch_size or not 0 <= d < dd_desc.batch_size:
                _raise(LLMStatusCode.LLM_PARAM_INVALID, f"block pair ({s}, {d}) out of range")
        for src_addr, dst_addr in zip(src_cache.tensor_addrs, dst_cache.tensor_addrs, strict=True):
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                ctypes.memmove(dst_addr + d * block_bytes, src_addr + s * block_bytes, block_bytes)


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        if not isinstance(role, LLMRole):
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "role must be LLMRole")
        if not isinstance(cluster_id, int) or not 0 <= cluster_id < 2**64:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "cluster_id must be uint64")
        self.role = role
        self.cluster_id = cluster_id
        self._inited = False
        self._cache_mgr: CacheManager | None = None
        self._listen: tuple[int, int] | None = None
        self._remote_accessible = False
        self._linked = False
        self.options: dict[str, str] = {}

    def init(self, options: dict[str, str]) -> None:
        if self._inited:
            return
        if not isinstance(options, dict) or "ge.exec.deviceId" not in options:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "ge.exec.deviceId is required")
        world = WORLD
        with world.lock:
            if self.cluster_id in world.clusters:
                _raise(LLMStatusCode.LLM_FAILED, f"cluster_id {self.cluster_id} is already initialised")
            if options.get("llm.EnableCacheManager") == "1":
                self._cache_mgr = CacheManager(self)
            self._remote_accessible = options.get("llm.EnableRemoteCacheAccessible") == "1"
            listen = options.get("llm.listenIpInfo")
            if listen:
                ip, _, port = listen.rpartition(":")
                self._listen = (_ip_to_int(ip), int(port))
                if self._listen in world.listeners:
                    _raise(LLMStatusCode.LLM_FAILED, f"{listen} is already listening")
                world.listeners[self._listen] = self.cluster_id
            world.clusters[self.cluster_id] = self
        self.options = dict(options)
        self._inited = True

    def finalize(self) -> None:
        if not self._inited:
            return
        world = WORLD
        with world.lock:
            world.clusters.pop(self.cluster_id, None)
            if self._listen is not None:
                world.listeners.pop(self._listen, None)
            for pair in [p for p in world.links if self.cluster_id in p]:
                world.links[pair] = False  # the peer side now holds a dead link
        self._inited = False

    def _check_inited(self) -> None:
        if not self._inited:
            raise RuntimeError("llm datadist is not initialized")

    @property
    def cache_manager(self) -> CacheManager:
        self._check_inited()
        if self._cache_mgr is None:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "cache_manager is not supported without EnableCacheManager")
        assert self._cache_mgr is not None
        return self._cache_mgr

    # link_clusters / unlink_clusters: return codes, they do not raise ---------------------

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        self._check_inited()
        if not isinstance(timeout, int) or timeout <= 0:
            _raise(LLMStatusCode.LLM_PARAM_INVALID, "Param timeout should be greater than 0.")
        world = WORLD
        world.record("link_clusters", self.cluster_id, [c.remote_cluster_id or 0 for c in clusters])
        if len(clusters) > MAX_CLUSTERS_PER_LINK_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        rets: list[LLMStatusCode] = []
        for info in clusters:
            if not info.local_ip_info_list:
                _raise(LLMStatusCode.LLM_PARAM_INVALID, "local_ip_info_list is empty.")
            rets.append(self._link_one(world, info))
        bad = [r for r in rets if r not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)]
        if rets and not bad:
            self._linked = True
        return (bad[0] if bad else LLMStatusCode.LLM_SUCCESS), rets

    def _link_one(self, world: World, info: LLMClusterInfo) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        if remote_id is None:
            return LLMStatusCode.LLM_PARAM_INVALID
        code = world.faults._take(world.faults._link, remote_id)
        if code is not None:
            return code
        pair = frozenset((self.cluster_id, remote_id))
        if world.links.get(pair):
            return LLMStatusCode.LLM_ALREADY_LINK
        if not any(world.listeners.get(addr) == remote_id for addr in info.remote_ip_info_list):
            return LLMStatusCode.LLM_LINK_FAILED  # nobody with that cluster id listens there
        world.links[pair] = True
        return LLMStatusCode.LLM_SUCCESS

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        self._check_inited()
        world = WORLD
        world.record("unlink_clusters", self.cluster_id, [c.remote_cluster_id or 0 for c in clusters])
        if len(clusters) > MAX_CLUSTERS_PER_LINK_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        rets = []
        for info in clusters:
            pair = frozenset((self.cluster_id, info.remote_cluster_id or 0))
            if pair in world.links:
                del world.links[pair]
                rets.append(LLMStatusCode.LLM_SUCCESS)
            else:
                rets.append(LLMStatusCode.LLM_NOT_YET_LINK)
        bad = [r for r in rets if r != LLMStatusCode.LLM_SUCCESS]
        return (bad[0] if bad else LLMStatusCode.LLM_SUCCESS), rets

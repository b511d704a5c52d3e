"""The working half of the fake `llm_datadist` (see `tests/fakes/fake_llmdatadist.py`): the in-process
world of clusters, listeners, caches and links, scripted faults, the CacheManager that copies real bytes,
and `LLMDataDist` itself."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.llmdatadist_api import (
    MAX_CLUSTERS_PER_LINK_CALL,
    MAX_REGISTERED_ADDRS,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMClusterInfo,
    LLMRole,
    LLMStatusCode,
    _ip_to_int,
    _raise,
)

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
    #: How long a pull waits on a closed ``gate`` before failing as the engine's sync_kv_timeout would.
    gate_timeout_s: float = 30.0

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
    """Forget every cluster, link, fault and recorded call (call between tests). In place: modules that
    imported `WORLD` keep seeing the live one."""
    fresh = World()
    WORLD.clusters, WORLD.listeners, WORLD.links = fresh.clusters, fresh.listeners, fresh.links
    WORLD.faults, WORLD.calls = fresh.faults, fresh.calls


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
        if world.faults.gate is not None and not world.faults.gate.wait(timeout=world.faults.gate_timeout_s):
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

"""The data half of the fake `llm_datadist` (see `tests/fakes/fake_llmdatadist.py`): status codes and the
exception, roles, dtypes, cache descriptors and keys, cluster info and `LLMConfig`, with the names,
fields and argument order of CANN's documented Python API."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from enum import Enum, IntEnum
from typing import NoReturn

#: Documented limits of CANN's llm_datadist (clusters per link call, registered addresses).
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
    # Documented names whose numeric values the documentation does not give (fake-only values).
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

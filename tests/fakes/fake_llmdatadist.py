"""FAKE ``llm_datadist`` for tests: CANN cannot run on these machines (no Ascend NPU, and the
module ships only inside the CANN toolkit, not on PyPI), so this stands in for it.

It follows the documented Python API of ``llm_datadist`` in CacheManager mode, as summarised in
hiascend's "LLM-DataDist API List" and the wrapper source in cann/hixl
(``src/python/llm_datadist``): the same class names (LLMDataDist, LLMConfig,
CacheDesc, BlocksCacheKey, Cache, LLMClusterInfo, LLMException, LLMStatusCode, LLMRole,
DataType, Placement, RegisterMemStatus), the same methods and argument order (init,
finalize, cache_manager, link_clusters / unlink_clusters returning ``(status, [status])``,
register_blocks_cache, unregister_cache, pull_blocks) and the status-code names, with the
C++ numeric values where the documentation lists them (``LLM_WAIT_PROC_TIMEOUT = 0x5010B001`` ...).

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

The module is in three files by job: `llmdatadist_api.py` (the data types), `llmdatadist_engine.py` (the
world, faults, CacheManager and LLMDataDist); this file is the module's face, which tests pass as
`llm_datadist=` or install as `sys.modules["llm_datadist"]`.
"""

from __future__ import annotations

from tests.fakes.llmdatadist_api import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LlmConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from tests.fakes.llmdatadist_engine import (
    WORLD,
    Faults,
    LLMDataDist,
    reset,
)

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

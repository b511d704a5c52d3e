"""pdgate metaserver: the instance registry and the KV handoff ledger.

The package's public face is the data contract and its client; `tests/unit/metaserver/test_exports.py`
checks that `__all__` lists exactly these names.
"""

from pdgate.metaserver.client import (
    MetaAPI,
    MetaBadRequest,
    MetaClient,
    MetaConflict,
    MetaError,
    MetaGone,
    MetaNotFound,
    MetaUnauthorized,
    MetaUnavailable,
    error_from_answer,
)
from pdgate.metaserver.models import (
    CONTRACT_VERSION,
    TERMINAL_STATES,
    AbortBody,
    ClaimBody,
    DoneBody,
    Handoff,
    HandoffCreate,
    HandoffEvent,
    HandoffEvents,
    HandoffState,
    HeartbeatBody,
    HeartbeatResponse,
    Instance,
    InstanceLoad,
    InstanceRegistration,
    InstanceState,
    KVLocation,
    Problem,
    RegisterResponse,
    Role,
    TransportAddress,
    TransportKind,
)

__version__ = "0.1.0"

__all__ = [
    "CONTRACT_VERSION",
    "TERMINAL_STATES",
    "AbortBody",
    "ClaimBody",
    "DoneBody",
    "Handoff",
    "HandoffCreate",
    "HandoffEvent",
    "HandoffEvents",
    "HandoffState",
    "HeartbeatBody",
    "HeartbeatResponse",
    "Instance",
    "InstanceLoad",
    "InstanceRegistration",
    "InstanceState",
    "KVLocation",
    "MetaAPI",
    "MetaBadRequest",
    "MetaClient",
    "MetaConflict",
    "MetaError",
    "MetaGone",
    "MetaNotFound",
    "MetaUnauthorized",
    "MetaUnavailable",
    "Problem",
    "RegisterResponse",
    "Role",
    "TransportAddress",
    "TransportKind",
    "error_from_answer",
]

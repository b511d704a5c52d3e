"""KV block transports behind one small interface (see ``base.py``).

Engine adapters (``nixl.py``, ``llmdatadist.py``) import their engine lazily, inside the
constructor, so importing this package never pulls in nixl, CANN or torch.
"""

from pdgate.connector.transport.base import (
    BlockRun,
    ByteRange,
    EngineError,
    InvalidPull,
    KVRegion,
    LinkError,
    PeerUnreachable,
    PullRequest,
    PullResult,
    PullTimeout,
    RegistrationError,
    RemoteKVMissing,
    RemotePeer,
    Transport,
    TransportClosed,
    TransportError,
    coalesce,
)

__all__ = [
    "BlockRun",
    "ByteRange",
    "EngineError",
    "InvalidPull",
    "KVRegion",
    "LinkError",
    "PeerUnreachable",
    "PullRequest",
    "PullResult",
    "PullTimeout",
    "RegistrationError",
    "RemoteKVMissing",
    "RemotePeer",
    "Transport",
    "TransportClosed",
    "TransportError",
    "coalesce",
    "transport_class",
]


def transport_class(kind: str) -> type[Transport]:
    """Map a transport ``kind`` (as found in a peer address) to its class, importing it lazily."""
    if kind == "nixl":
        from pdgate.connector.transport.nixl import NixlTransport

        return NixlTransport
    if kind == "llmdatadist":
        from pdgate.connector.transport.llmdatadist import LLMDataDistTransport

        return LLMDataDistTransport
    raise ValueError(f"unknown transport kind {kind!r}; expected 'nixl' or 'llmdatadist'")

"""KV block transports behind one small interface: ``base.py`` (the interface and the shapes of a pull),
``errors.py`` (the failures); import them from there.

Engine adapters (``nixl.py``, ``mooncake.py``, ``llmdatadist.py``) import their engine lazily, inside the
constructor, so importing this package never pulls in nixl, CANN or torch.
"""

from pdgate.connector.transport.base import Transport

__all__ = ["transport_class"]


def transport_class(kind: str) -> type[Transport]:
    """Map a transport ``kind`` (as found in a peer address) to its class, importing it lazily."""
    if kind == "nixl":
        from pdgate.connector.transport.nixl import NixlTransport

        return NixlTransport
    if kind == "mooncake":
        from pdgate.connector.transport.mooncake import MooncakeTransport

        return MooncakeTransport
    if kind == "llmdatadist":
        from pdgate.connector.transport.llmdatadist import LLMDataDistTransport

        return LLMDataDistTransport
    raise ValueError(f"unknown transport kind {kind!r}; expected 'nixl', 'mooncake' or 'llmdatadist'")

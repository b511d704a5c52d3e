"""Forwarding loops: a router must never end up as its own engine, directly or through another router.

Why: a router registered as an instance (its own address, or a second router that lists the first)
forwards each request back into itself, and every hop adds the retries of the hop before: one client
request became 50 nested ones. Two guards, both cheap:

- every request the router sends to an engine carries `X-PDGate-Hop`; a proxied request that arrives
  with it came from a router, so it is answered 508 at once (`LoopDetected`) instead of being
  forwarded again. An engine never sends the header, so ordinary traffic is unaffected;
- the embedded metaserver refuses to register an instance whose URL is the address the registration
  itself arrived on (`is_own_address`), so the mistake is a 422 at start-up, not a loop in production.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pdgate.router.errors import RouterError

from pdgate.errors import Code

__all__ = ["HOP_HEADER", "HOP_VALUE", "LoopDetected", "is_own_address"]

HOP_HEADER = b"x-pdgate-hop"
HOP_VALUE = b"1"

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class LoopDetected(RouterError):
    """508: the request already passed through a pdgate router; forwarding it again would loop."""

    code = Code.LOOP_DETECTED


def _is_local(host: str) -> bool:
    if host.lower() in _LOCAL_NAMES or host in _WILDCARDS:
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified


def _norm(host: str) -> str:
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host.lower().rstrip(".")
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def is_own_address(url: str, server: tuple[str, int] | None) -> bool:
    """Whether `url` points at the socket `server` (host, port) that this router listens on.

    Same port, and the same host or both local (loopback names, 127/8, ::1, a wildcard). A name that
    only DNS could resolve to this machine is not caught here; the hop header catches that loop."""
    if server is None:
        return False
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    host = parts.hostname or ""
    own_host, own_port = server
    if port != own_port:
        return False
    if _norm(host) == _norm(own_host):
        return True
    return _is_local(host) and _is_local(own_host)

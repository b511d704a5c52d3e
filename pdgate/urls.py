"""The one rule for an engine's base URL, used at registration (metaserver) and for static engines (router).

Why strict: the router sends every client's prompt to this URL, and a URL that parses differently in
two places (userinfo, a path that changes where requests go, a port that only fails when dialled) turns
one bad registration into failed health checks for everyone. A valid engine URL is
`http[s]://host:port` with an optional trailing `/`: a host (name, IPv4, or bracketed IPv6), a port from
1 to 65535 when given, and no userinfo, query, fragment or other path.

`allowed` narrows it further: when networks are configured, the host must be a literal address inside
one of them (a name could resolve anywhere, so it is refused).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["IPNetwork", "InvalidEngineURL", "check_engine_url", "parse_networks"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")
_PORT = re.compile(r"^[0-9]{1,5}$")


class InvalidEngineURL(ValueError):
    """The URL breaks the rule; the message says which part."""


def parse_networks(spec: str | Sequence[str]) -> tuple[IPNetwork, ...]:
    """`10.0.0.0/8,fd00::/8` (or a list of CIDRs) as networks; a malformed entry raises ValueError naming it."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    nets: list[IPNetwork] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"allowed_engine_networks: {item!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
    return tuple(nets)


def _host_and_port(netloc: str) -> tuple[str, str | None]:
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            raise InvalidEngineURL("an IPv6 host needs its closing ']'")
        host, rest = netloc[1:end], netloc[end + 1 :]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise InvalidEngineURL(f"{host!r} in brackets is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise InvalidEngineURL("only ':port' may follow an IPv6 host")
        return host, rest[1:] if rest else None
    host, sep, port = netloc.rpartition(":")
    if not sep:
        return netloc, None
    if ":" in host:
        raise InvalidEngineURL("an IPv6 host must be in brackets, e.g. http://[fd00::5]:8100")
    return host, port


def check_engine_url(url: str, allowed: Sequence[IPNetwork] = ()) -> str:
    """`url` without its trailing '/', or InvalidEngineURL saying what is wrong with it."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise InvalidEngineURL("whitespace or control characters are not allowed")
    scheme, sep, after = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise InvalidEngineURL("scheme must be http:// or https://")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidEngineURL(str(exc)) from None
    netloc = after.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" in netloc:
        raise InvalidEngineURL("userinfo (user:password@) is not allowed")
    if parts.query or "?" in after:
        raise InvalidEngineURL("a query ('?...') is not allowed")
    if parts.fragment or "#" in after:
        raise InvalidEngineURL("a fragment ('#...') is not allowed")
    if parts.path not in ("", "/"):
        raise InvalidEngineURL(f"path must be empty or '/', not {parts.path!r} (give the server's base URL)")
    if not netloc:
        raise InvalidEngineURL("a host is required, e.g. http://10.0.0.5:8100")
    host, port = _host_and_port(netloc)
    if not host:
        raise InvalidEngineURL("a host is required, e.g. http://10.0.0.5:8100")
    if port is not None:
        if not _PORT.match(port) or not 1 <= int(port) <= 65535:
            raise InvalidEngineURL(f"port {port!r} must be a number from 1 to 65535")
    address: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        address = None
        if not _HOSTNAME.match(host):
            raise InvalidEngineURL(f"host {host!r} is neither an address nor a valid host name") from None
    if allowed:
        if address is None:
            raise InvalidEngineURL(
                f"host {host!r} is a name; with allowed engine networks set, use a literal address inside them"
            )
        if not any(address in net for net in allowed):
            nets = ", ".join(str(n) for n in allowed)
            raise InvalidEngineURL(f"host {host} is outside the allowed engine networks ({nets})")
    return url[:-1] if url.endswith("/") else url


_UNSAFE = re.compile(r"[^A-Za-z0-9._:\-]")


def static_instance_id(url: str) -> str:
    """The instance id of a static (flag-given) instance: derived from its URL, so that `pdgate-sim`
    started without --instance-id records the same id in the ledger as the router gives it."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return _UNSAFE.sub("-", f"{host}-{port}")[:128].lstrip("-._:") or "instance"

"""Credentials: one constant-time comparison, secrets read from files, and the loopback rule.

Why one module: the admin token (engines and operators -> metaserver), the client API keys (clients ->
router) and the upstream API key (router -> engines) are compared and loaded the same way everywhere.
A comparison that stops at the first differing byte leaks, over many tries, how much of a guess is
right; `hmac.compare_digest` does not, and `matches_any` checks every configured key, so the answer
time does not reveal which key (or whether any) came close.

Secrets never need to appear on a command line (where `ps` and shell histories show them): every secret
setting has a `*_file` twin naming a file whose first line is the secret, and an environment variable.

When no admin token is configured, the services run in protected mode (as Redis does): routes that
change state or reveal internal addresses answer only peers on the loopback interface.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "SecretFileError",
    "bearer",
    "credential_matches",
    "derive_key",
    "engine_of",
    "engine_token",
    "is_loopback",
    "matches_any",
    "read_secret_file",
    "read_secret_lines",
    "resolve_secret",
]


class SecretFileError(ValueError):
    """A secret file that cannot be used: missing, unreadable, empty, or readable by other users."""


def credential_matches(given: str | None, expected: str) -> bool:
    """Whether `given` equals `expected`, in time that depends only on the lengths (never on content)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def matches_any(given: str | None, expected: Iterable[str]) -> bool:
    """Whether `given` equals one of `expected`; every key is compared, so the time reveals nothing."""
    found = False
    for key in expected:
        found |= credential_matches(given, key)
    return found


def derive_key(secret: str, purpose: str) -> bytes:
    """A key for one purpose, derived from a configured secret (HMAC-SHA256 of the purpose under it).

    Why derive: a token sent as a bearer credential must not also be the MAC key of something else, and
    two purposes must not share a key; deriving keeps one secret to configure and rotate.
    """
    return hmac.new(secret.encode("utf-8"), purpose.encode("utf-8"), "sha256").digest()


_ENGINE_PREFIX = "pdgate-engine."


def engine_token(secret: str, instance_id: str) -> str:
    """The credential of one engine instance, derived from the admin token (`secret`).

    Why: with the shared admin token any engine could move any prefill's handoffs. An engine token names
    its instance (`pdgate-engine.<id>.<mac>`), and the metaserver lets it move only that instance's side
    of a handoff (`metaserver.guards`). Derived, not stored: nothing to provision but the admin token,
    and rotating that rotates every engine token.
    """
    return f"{_ENGINE_PREFIX}{instance_id}.{derive_key(secret, 'engine-token:' + instance_id).hex()}"


def engine_of(token: str | None, secret: str) -> str | None:
    """The instance id an engine token was made for under `secret`, or None (not an engine token, or forged).

    The MAC is compared in constant time; the id it names is public (it is in the token)."""
    if token is None or not token.startswith(_ENGINE_PREFIX):
        return None
    instance_id, _, _mac = token[len(_ENGINE_PREFIX) :].rpartition(".")
    if not instance_id or not credential_matches(token, engine_token(secret, instance_id)):
        return None
    return instance_id


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value; None for any other shape."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def _read_private(path: str | os.PathLike[str]) -> tuple[Path, str]:
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SecretFileError(f"cannot read secret file {str(p)!r}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(
            f"secret file {str(p)!r} is accessible to other users (mode {stat.filemode(mode)}): chmod 600 it"
        )
    return p, text


def read_secret_lines(path: str | os.PathLike[str]) -> list[str]:
    """Every non-blank line of `path`, stripped (a file of client API keys, one per line).

    Refused like `read_secret_file`: unreadable, readable by other users, or without any secret.
    """
    p, text = _read_private(path)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise SecretFileError(f"secret file {str(p)!r} is empty")
    return lines


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret on the first line of `path` (surrounding whitespace removed).

    Refused: a file that does not exist or cannot be read, an empty secret, and a file that other users
    may read (mode bits for group or others): a secret that anyone on the host can read protects nothing.
    """
    p, text = _read_private(path)
    secret = text.splitlines()[0].strip() if text.strip() else ""
    if not secret:
        raise SecretFileError(f"secret file {str(p)!r} is empty")
    return secret


def resolve_secret(value: str | None, file: str | os.PathLike[str] | None, *, name: str) -> str | None:
    """One secret from either its value or its file; both at once is an operator error, said so."""
    if value is not None and file is not None:
        raise SecretFileError(f"{name} and {name}_file are both set: keep one (the file keeps it off command lines)")
    if file is not None:
        return read_secret_file(file)
    if value is not None and not value.strip():
        raise SecretFileError(f"{name} is set but empty")
    return value.strip() if value is not None else None


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is on the loopback interface (127.0.0.0/8, ::1, an IPv4-mapped 127.x).

    A Unix-socket peer (no address) is local too. A name is never trusted: only a literal address is.
    """
    if host is None or host == "":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback

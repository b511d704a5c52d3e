"""The transports' failures, one type per cause: what a pull's outcome and a handoff's abort carry.

Exception tree (``code``, from :class:`pdgate.errors.Code`, is stable and goes into the pull's
outcome and the reason of the handoff's abort). A failed pull is not retried: the decode reports its
blocks as load errors and vLLM fails or recomputes the request (``kv_load_failure_policy``)::

    PDGateError (pdgate.errors)
    └── TransportError              transport_error
        ├── InvalidPull              transport_bad_request
        ├── RegistrationError       transport_registration_failed
        ├── TransportClosed         transport_closed
        ├── RemoteKVMissing         transport_remote_kv_missing
        ├── EngineError             transport_engine_error
        ├── PeerUnreachable         transport_peer_unreachable
        ├── LinkError               transport_link_failed
        └── PullTimeout             transport_pull_timeout
"""

from __future__ import annotations

from pdgate.errors import Code, PDGateError

__all__ = [
    "EngineError",
    "InvalidPull",
    "LinkError",
    "PeerUnreachable",
    "PullTimeout",
    "RegistrationError",
    "RemoteKVMissing",
    "TransportClosed",
    "TransportError",
]


class TransportError(PDGateError):
    """Base of every transport failure.

    ``code`` (a :class:`pdgate.errors.Code`) is a class attribute so callers can switch on the type or
    the code without string matching. ``engine_code`` keeps the engine's own status (``LLM_LINK_FAILED``,
    ``nixlBackendError``) for diagnostics; it is never used for control flow.
    """

    code = Code.TRANSPORT_ERROR

    def __init__(self, message: str, *, engine_code: str | None = None) -> None:
        super().__init__(message)
        self.engine_code = engine_code

    def __str__(self) -> str:
        suffix = f" [{self.engine_code}]" if self.engine_code else ""
        return f"{self.code.value}: {self.message}{suffix}"


class InvalidPull(TransportError):
    """The request can never succeed as written (mismatched lists, ids out of range, wrong peer kind)."""

    code = Code.TRANSPORT_BAD_REQUEST


class RegistrationError(TransportError):
    """Memory could not be registered (bad region, engine limit such as llm_datadist's 240 addresses)."""

    code = Code.TRANSPORT_REGISTRATION_FAILED


class TransportClosed(TransportError):
    """The transport was used after ``close()``."""

    code = Code.TRANSPORT_CLOSED


class RemoteKVMissing(TransportError):
    """The peer is reachable but has no cache under the key we asked for."""

    code = Code.TRANSPORT_REMOTE_KV_MISSING


class EngineError(TransportError):
    """The engine failed in a way we have no better name for."""

    code = Code.TRANSPORT_ENGINE_ERROR


class PeerUnreachable(TransportError):
    """The peer cannot be reached or went away mid-transfer (process died, connection refused)."""

    code = Code.TRANSPORT_PEER_UNREACHABLE


class LinkError(TransportError):
    """Building or using the link to the peer failed; a fresh link may work."""

    code = Code.TRANSPORT_LINK_FAILED


class PullTimeout(TransportError):
    """The pull did not finish within its deadline. The link to that peer has been torn down."""

    code = Code.TRANSPORT_PULL_TIMEOUT

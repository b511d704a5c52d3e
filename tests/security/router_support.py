"""Real parts for the router's security tests: engines that record what reached them, raw sockets,
and a second local address (so a peer is not on the loopback interface)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from tests.support.ports import free_port
from tests.support.servers import UvicornThread

__all__ = ["RecordingEngine", "non_loopback_ipv4", "raw_exchange"]


def non_loopback_ipv4() -> str | None:
    """An address of this host that is not loopback, or None (the caller skips)."""
    candidates: list[str] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for ip in candidates:
        if ip.startswith("127.") or ip == "0.0.0.0":
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
        except OSError:
            continue
        return ip
    return None


class RecordingEngine:
    """A pdgate-sim app on a real socket, behind a wrapper that keeps every request's headers."""

    def __init__(self, role: str = "both", **sim: Any) -> None:
        from pdgate.sim.app import create_app as create_sim_app
        from pdgate.sim.settings import SimSettings

        port = free_port()
        self.app = create_sim_app(SimSettings(role=role, port=port, **sim))  # type: ignore[arg-type]
        self.seen: list[dict[bytes, bytes]] = []
        self.server = UvicornThread(self._asgi, port=port)
        self.url = self.server.url

    async def _asgi(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            self.seen.append(dict(scope["headers"]))
        await self.app(scope, receive, send)

    def __enter__(self) -> RecordingEngine:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def raw_exchange(
    host: str, port: int, data: bytes, *, source: str | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a fresh TCP connection (from `source` if given) and parse the one answer."""
    with socket.create_connection((host, port), timeout=timeout, source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, headers, body

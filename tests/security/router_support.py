"""Real parts for the router's security tests: engines that record what reached them, raw sockets,
and a second local address (so a peer is not on the loopback interface)."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.integration.router.conftest import Sim
from tests.support.ports import free_port

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
    """A pdgate-sim process behind a TCP relay that keeps the header block of every request it carries.

    A relay rather than an in-process wrapper: the engine stays a separate process, exactly as the
    router sees a real one, and what is recorded is what went over the wire."""

    def __init__(self, role: str = "both") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sim = Sim(role, "--advertise-url", self.url)  # its instance id follows the URL the router uses
        self.seen: list[dict[bytes, bytes]] = []
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> RecordingEngine:
        self.sim.wait()
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()
        self.sim.stop()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.sim.port))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        buf = b""
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
                if record:
                    buf = self._record(buf + chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _record(self, buf: bytes) -> bytes:
        """Pull complete request heads out of `buf`; bodies are skipped by their Content-Length."""
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            lines = buf[:end].split(b"\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
            length = int(headers.get(b"content-length", b"0"))
            if len(buf) < end + 4 + length:
                break
            if lines[0].startswith(b"POST /v1/"):
                self.seen.append(headers)
            buf = buf[end + 4 + length :]
        return buf


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

"""An engine that keeps every request it was sent, whole: request line, header lines in order (repeats
kept) and body length. For the tests of what the router forwards (trace context, pass-through bodies)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.security.router_support import RecordingEngine

__all__ = ["EngineLog", "Sent"]


@dataclass(frozen=True)
class Sent:
    line: bytes  # b"POST /v1/completions HTTP/1.1"
    headers: list[tuple[bytes, bytes]]  # names lowercased, in order, repeats kept
    body: int  # bytes of body that came with it

    @property
    def path(self) -> bytes:
        return self.line.split(b" ")[1]

    def values(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


class EngineLog(RecordingEngine):
    """`RecordingEngine` (a pdgate-sim behind a relay) that records every request in `sent`."""

    def __init__(self, role: str = "both") -> None:
        super().__init__(role)
        self.sent: list[Sent] = []

    def posts(self, path: bytes) -> list[Sent]:
        return [s for s in self.sent if s.line.startswith(b"POST ") and s.path == path]

    def _record(self, buf: bytes) -> bytes:
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            lines = buf[:end].split(b"\r\n")
            headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(b":") for ln in lines[1:])]
            length = int(dict(headers).get(b"content-length", b"0"))
            if len(buf) < end + 4 + length:
                break
            self.sent.append(Sent(lines[0], headers, length))
            buf = buf[end + 4 + length :]
        return buf

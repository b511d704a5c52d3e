"""Free loopback ports and readiness polling (poll, never sleep a fixed time)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

__all__ = ["free_port", "wait_until"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out; a listener started right after gets it in practice."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> None:
    """Poll `check` until it holds; raise TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)

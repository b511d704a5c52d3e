"""Free loopback ports and readiness polling (poll, never sleep a fixed time).

`free_port` is the launcher's own (`pdgate.deploy.local.procs`): one rule for where a port comes from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdgate.deploy.local.procs import free_port

__all__ = ["free_port", "wait_until"]


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

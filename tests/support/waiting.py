"""Waiting on a condition inside an event loop (the async twin of `ports.wait_until`): poll, never sleep
a fixed time and then expect, which flakes on a loaded machine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["until"]


async def until(check: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition") -> None:
    """Yield to the loop until `check()` holds; `TimeoutError` naming `what` after `timeout` seconds (the
    bound only stops a hang: it is not what the test asserts)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.005)

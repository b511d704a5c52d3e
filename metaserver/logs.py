"""Logging set-up: every record carries the transfer id (or instance id) it is about.

Why a contextvar: the id is set once where a request enters (`api.py`, `service.py`) and every log line
below it, in the store or the sweeper, carries it without passing it through each call.
"""

from __future__ import annotations

import contextvars
import logging

__all__ = ["ContextFilter", "configure_logging", "subject"]

subject: contextvars.ContextVar[str] = contextvars.ContextVar("pdgate_subject", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(subject)s] %(message)s"


class ContextFilter(logging.Filter):
    """Adds `subject` (transfer or instance id of the current request) to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "subject"):
            record.subject = subject.get()
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

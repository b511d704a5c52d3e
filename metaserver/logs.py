"""Logging set-up: every record carries the transfer id of the handoff it is about.

Why a contextvar: the id is set once where a ledger call enters (`service.py`) and every log line below
it, in the store or the sweeper, carries it without passing it through each call. Registry calls set
nothing (their lines name the instance themselves); a record outside any handoff shows "-". The
router's log filter reads this variable for the lines its embedded metaserver logs.
"""

from __future__ import annotations

import contextvars
import logging

__all__ = ["TransferIdFilter", "configure_logging", "transfer_id"]

transfer_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdgate_metaserver_transfer_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(transfer_id)s] %(message)s"


class TransferIdFilter(logging.Filter):
    """Adds `transfer_id` (of the handoff the current task is about) to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "transfer_id"):
            record.transfer_id = transfer_id.get()
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(TransferIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

"""Logging set-up: every record carries the transfer id of the request it is about.

Why a contextvar: the proxy sets it once per request (`transfer_id.set(...)`) and every log line below,
in the pool, the policies or the embedded metaserver, carries it without passing it through each call.
Records logged outside a request show the transfer id the embedded metaserver is handling, or "-".
The connector and the metaserver call the same field `transfer_id`.
"""

from __future__ import annotations

import contextvars
import logging

from pdgate.metaserver.logs import transfer_id as metaserver_transfer_id

__all__ = ["TransferIdFilter", "configure_logging", "transfer_id"]

transfer_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdgate_transfer_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(transfer_id)s] %(message)s"


class TransferIdFilter(logging.Filter):
    """Adds `transfer_id` (of the request, else of the embedded metaserver's handoff) to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "transfer_id"):
            tid = transfer_id.get()
            record.transfer_id = metaserver_transfer_id.get() if tid == "-" else tid
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(TransferIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

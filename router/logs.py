"""Logging set-up: every record carries the transfer id of the request it is about.

Why a contextvar: the proxy sets it once per request (`transfer_id.set(...)`) and every log line below,
in the pool, the policies or the embedded metaserver, carries it without passing it through each call.
Records logged outside a request show the metaserver's own subject (instance or transfer id) or "-".
"""

from __future__ import annotations

import contextvars
import logging

from pdgate.metaserver.logs import transfer_id as metaserver_transfer_id

__all__ = ["TransferIdFilter", "configure_logging", "transfer_id"]

transfer_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdgate_transfer_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(transfer_id)s] %(message)s"


class TransferIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        tid = getattr(record, "transfer_id", None)
        if tid is None:
            tid = transfer_id.get()
            if tid == "-":
                tid = metaserver_transfer_id.get()
            record.transfer_id = tid
        if not hasattr(record, "subject"):
            record.subject = tid
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(TransferIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

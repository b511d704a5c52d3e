"""Logging set-up for the router, the metaserver and the simulator: every record carries the transfer id
of the request or handoff it is about.

Why one contextvar for all services: the router sets it once per request (`router/proxy.py`), the
metaserver where a ledger call enters (`metaserver/service.py`), and every log line below, in the pool,
the policies, the store or the sweeper, carries it without passing it through each call. A router with
the metaserver embedded logs both under the one id. A record outside any request shows "-". The
connector logs the same field name `transfer_id` through vLLM's logger (`connector/logs.py`).
"""

from __future__ import annotations

import contextvars
import logging

__all__ = ["TransferIdFilter", "configure_logging", "transfer_id"]

transfer_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdgate_transfer_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(transfer_id)s] %(message)s"


class TransferIdFilter(logging.Filter):
    """Adds `transfer_id` (of the request or handoff the current task is about) to each record."""

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
    # httpx logs every request at INFO: the router's registry and metrics polls would fill its log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))

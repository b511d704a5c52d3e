"""The connector's log lines: every line about a handoff carries its id as the record attribute `transfer_id`.

`transfer_id` is the name the router and the metaserver give the same context (their formatters print
`[%(transfer_id)s]`), so one filter or one log query follows a handoff through all three. The connector
cannot use a context variable as they do: its lines come from vLLM's hooks and the control thread, not
from one task per request, so each call passes `extra=about(transfer_id)`. The id also stays in the text
("transfer <id>: ..."), because vLLM's processes may format records with a handler of their own.
"""

from __future__ import annotations

import logging

__all__ = ["TransferIdFilter", "about", "setup_logging"]

_FORMAT = "(pdgate) %(levelname)s %(asctime)s [%(name)s] %(message)s"


def about(transfer_id: str) -> dict[str, str]:
    """The `extra` of a log call about one handoff."""
    return {"transfer_id": transfer_id}


class TransferIdFilter(logging.Filter):
    """Gives every record a `transfer_id` ("-" for lines about no handoff), so formats may name it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "transfer_id"):
            record.transfer_id = "-"
        return True


def setup_logging(level: str) -> None:
    """vLLM configures only its own `vllm` logger; give ours a handler so INFO lines are seen."""
    log = logging.getLogger("pdgate.connector")
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(TransferIdFilter())
        log.addHandler(handler)
        log.propagate = False

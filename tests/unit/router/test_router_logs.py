"""logs.py: records carry the transfer id of the request they were logged in."""

from __future__ import annotations

import logging

from pdgate.logs import TransferIdFilter, transfer_id


def test_records_carry_the_transfer_id() -> None:
    record = logging.LogRecord("router", logging.INFO, __file__, 1, "msg", None, None)
    token = transfer_id.set("pd-abc-1")
    try:
        assert TransferIdFilter().filter(record)
    finally:
        transfer_id.reset(token)
    assert record.transfer_id == "pd-abc-1"  # type: ignore[attr-defined]
    outside = logging.LogRecord("router", logging.INFO, __file__, 1, "msg", None, None)
    TransferIdFilter().filter(outside)
    assert outside.transfer_id == "-"  # type: ignore[attr-defined]

"""The services' log set-up: every line carries the transfer id, and per-request client chatter stays out."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pdgate import logs


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    httpx_level = logging.getLogger("httpx").level
    yield
    root.handlers[:], root.level = handlers, level
    logging.getLogger("httpx").setLevel(httpx_level)


def test_httpx_request_lines_stay_out_of_an_info_log(restore_logging: None) -> None:
    # The router polls the metaserver's /metrics every few seconds through httpx, which logs each request at
    # INFO: the walkthrough's router log was mostly those lines.
    logs.configure_logging("info")
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
    assert logging.getLogger("pdgate.router").isEnabledFor(logging.INFO)


def test_every_record_carries_the_transfer_id(restore_logging: None) -> None:
    logs.configure_logging("debug")
    record = logging.LogRecord("pdgate.x", logging.INFO, __file__, 1, "m", None, None)
    token = logs.transfer_id.set("t-123")
    try:
        assert logging.getLogger().handlers[0].filter(record)
    finally:
        logs.transfer_id.reset(token)
    assert record.__dict__["transfer_id"] == "t-123"

"""Where the launcher's (and the tests') ports come from: below the kernel's ephemeral range, free.

The bug this guards against: a port from `bind(0)` is the kernel's to hand out again as the local port
of any outgoing connection; a server binding it seconds later found it taken (a Sentinel in CI).
"""

from __future__ import annotations

import socket

import pytest
from pdgate.deploy.local import procs
from pdgate.deploy.local.procs import ephemeral_range, free_port, port_is_free


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    lo, hi = ephemeral_range()
    assert 0 < lo <= hi < 65536
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # random, not one port handed to everyone
    assert all(port < lo and port_is_free(port) for port in ports), sorted(ports)


def test_a_span_keeps_both_ports_free_and_below_the_range() -> None:
    lo, _ = ephemeral_range()
    port = free_port(span=10000)
    assert port + 10000 < lo
    assert port_is_free(port) and port_is_free(port + 10000)


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        taken = int(busy.getsockname()[1])
        picks = iter([taken, taken, taken + 1])
        monkeypatch.setattr(procs.random, "randint", lambda a, b: next(picks))
        assert free_port() == taken + 1


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    assert port >= 1024 and port_is_free(port)

"""`ControlProcess`: the control thread (`control.ControlThread`) in a child process of its own.

Why: in the engine's process the control thread shares the GIL with the engine loop, which holds it
almost all the time; every socket call or event-loop turn of the control thread is a GIL hand-over it
may wait a whole switch interval for (`bench/control.py` measures it). In a child process the ledger
calls have an interpreter to themselves, and the engine thread pays only for what it does anyway at its
hooks: one pipe write per `submit()` and non-blocking pipe reads in `drain()`.

Same API as `ControlThread` (`submit`, `publish_load`, `publish_stats`, `drain`, `close`, `feed_ok_at`),
so the scheduler half cannot tell them apart. Commands and results are the frozen dataclasses of
`messages.py` (the load and the stats snapshot as they are), pickled, one length-prefixed frame each,
over two pipes. The child runs `python -m pdgate.connector.control_process <cmd fd> <result fd>`
(a plain subprocess, not multiprocessing: vLLM's engine core may be a daemonic process, which
multiprocessing forbids to have children), receives its `ConnectorConfig` as the first frame, and exits
when the parent's end of the command pipe closes (the parent exited or died) after a goodbye of its own.
The feed's liveness travels as `FeedStatus` results and becomes `feed_ok_at` here (`time.monotonic` is
one clock for every process of the host).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pdgate.connector.config import ConnectorConfig
from pdgate.connector.messages import Command, FeedStatus, Result

from pdgate.models import InstanceLoad

__all__ = ["ControlProcess", "main"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_PIPE_BYTES = 1 << 20  # one step's commands (READY locations included) fit without blocking the engine
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write part of a large frame (a signal mid-write): write the rest."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _grow(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:  # not Linux, or above /proc/sys/fs/pipe-max-size: the default size still works
        pass


class _Frames:
    """Whole frames out of a byte stream read in pieces."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + size:
                break
            out.append(pickle.loads(bytes(self._buf[_HEADER.size : _HEADER.size + size])))
            del self._buf[: _HEADER.size + size]
        return out


class ControlProcess:
    """`ControlThread`'s API, served by a child process (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, *, python: str = sys.executable) -> None:
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        _grow(cmd_w)
        _grow(res_w)
        self._proc = subprocess.Popen(
            [python, "-m", "pdgate.connector.control_process", str(cmd_r), str(res_w)],
            pass_fds=(cmd_r, res_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        self._out = cmd_w
        self._in = res_r
        os.set_blocking(self._in, False)
        self._frames = _Frames()
        self._closed = False
        self._gone = False
        self.feed_ok_at: float | None = None
        self._send(("config", cfg))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, message: Any) -> None:
        if self._gone:
            return
        try:
            _write_all(self._out, _frame(message))
        except OSError as exc:  # the child died: the scheduler half's local deadlines take over
            self._gone = True
            logger.error("pdgate control process %d is gone (%s); ledger calls stop", self._proc.pid, exc)

    def submit(self, commands: list[Command]) -> None:
        if commands and not self._closed:
            self._send(("commands", commands))

    def publish_load(self, load: InstanceLoad) -> None:
        if not self._closed:
            self._send(("load", load))

    def publish_stats(self, snapshot: dict[str, Any]) -> None:
        if not self._closed:
            self._send(("stats", snapshot))

    def drain(self) -> list[Result]:
        out: list[Result] = []
        while True:
            try:
                data = os.read(self._in, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                if not self._gone and not self._closed:
                    self._gone = True
                    logger.error("pdgate control process %d exited; ledger calls stop", self._proc.pid)
                break
            for result in self._frames.feed(data):
                if isinstance(result, FeedStatus):
                    self.feed_ok_at = result.at
                else:
                    out.append(result)
        return out

    def close(self, *, abort_transfer_ids: Sequence[str] = (), timeout: float = 3.0) -> None:
        """Ask the child to abort what we hold, deregister and exit; kill it if it does not. Idempotent."""
        if self._closed:
            return
        self._send(("close", list(abort_transfer_ids), timeout))
        self._closed = True
        os.close(self._out)
        try:
            self._proc.wait(timeout + 2.0)
        except subprocess.TimeoutExpired:
            logger.warning("pdgate control process %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        os.close(self._in)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: read commands from the parent, run a ControlThread, send its results back."""
    from pdgate.connector.control import ControlThread  # the child's own import (the parent may not need it)
    from pdgate.connector.logs import setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    cmd_fd, res_fd = int(args[0]), int(args[1])
    lock = threading.Lock()

    def emit(result: Result) -> None:
        with lock:
            _write_all(res_fd, _frame(result))

    frames = _Frames()
    control: ControlThread | None = None
    abort_ids: list[str] = []
    timeout = 3.0
    while True:
        data = os.read(cmd_fd, 1 << 16)
        if not data:  # the parent closed its end (close(), exit or death)
            break
        for kind, *rest in frames.feed(data):
            if kind == "config":
                setup_logging(rest[0].log_level)  # the engine's connector log settings, same format
                control = ControlThread(rest[0], emit=emit)
            elif kind == "commands" and control is not None:
                control.submit(rest[0])
            elif kind == "load" and control is not None:
                control.publish_load(rest[0])
            elif kind == "stats" and control is not None:
                control.publish_stats(rest[0])
            elif kind == "close":
                abort_ids, timeout = rest[0], rest[1]
    if control is not None:
        control.close(abort_transfer_ids=abort_ids, timeout=timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pdgate-router --workers N`: N processes serve one port, so the router uses every core (issue 12).

How: each worker is a forked copy of the router with its own listening socket on the same address,
bound with SO_REUSEPORT, so the kernel spreads new connections over the workers by hash (no accept
lock, no thundering herd, and a busy worker does not pull connections away from an idle one the way
a shared accept queue read by N event loops does). The parent binds the address first without
listening, only to hold the port (and to learn it, with `--port 0`); it serves nothing, forwards
SIGTERM/SIGINT to the workers, and starts a worker again if one dies (not in a crash loop).

What each worker has of its own, and why that stays coherent:
- instances: each reads the registry every `refresh_interval_s` from the one metaserver/store;
- health: each probes every engine every `health_interval_s`, so a dead engine leaves the rotation of
  every worker within one health interval (and at once, on its own failed requests, via the breaker);
  the cost is N probes per engine per interval;
- load: each counts its own in-flight requests, live; the policies add the engine's last report to the
  registry (which every worker reads) less what the worker itself had in flight when it came in, so
  each sees the others' share as of that report (`pool.LiveInstance.others`);
- the ledger: one ledger, because it lives in the store. `--workers > 1` therefore needs either
  `--metaserver URL` or an embedded metaserver on a shared store (every scheme of
  `metaserver.store.SCHEMES` but `memory://`: Redis, Sentinel, Cluster, TLS or not): N in-process `memory://`
  stores would be N ledgers that do not know each other's handoffs (a decode sent by worker 1 could not
  claim a handoff that worker 2 recorded), so that combination is refused at start (status 2). Every
  worker then runs an embedded metaserver replica on the same Redis, which is what replicas are for
  (metaserver state lives only in the store).
- metrics: `/metrics` answers for the worker that took the scrape (per-process counters).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

from pdgate.metaserver.store import SCHEMES
from pdgate.router.settings import RouterSettings

__all__ = ["listening_socket", "run_workers", "shared_store", "workers_problem"]

log = logging.getLogger("pdgate.router.workers")

_CRASHES_ALLOWED = 5  # within _CRASH_WINDOW_S: then the router stops instead of restarting in a loop
_CRASH_WINDOW_S = 60.0


_PROCESS_LOCAL = "memory"  # the one store scheme whose state lives in the process that opened it


def shared_store(url: str) -> bool:
    """Whether every process that opens `url` sees the same ledger: any scheme the metaserver's stores
    know (`metaserver.store.SCHEMES`, the one table of them; schemes are case-insensitive) but memory://."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return scheme in SCHEMES and scheme != _PROCESS_LOCAL


def workers_problem(settings: RouterSettings) -> str | None:
    """Why these settings cannot run with their `--workers`, or None."""
    if settings.workers > 1 and settings.embedded and not shared_store(settings.store):
        return (
            f"--workers {settings.workers} needs one ledger for all workers: give --store redis://... to the "
            f"embedded metaserver, or --metaserver URL (the store {settings.store.split('://')[0]}:// would be "
            "one ledger per worker)"
        )
    return None


def _bound(host: str, port: int, *, listen: int | None) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    if listen is not None:
        sock.listen(listen)
        sock.set_inheritable(True)
    return sock


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """One worker's own listening socket on the shared address (SO_REUSEPORT)."""
    return _bound(host, port, listen=backlog)


def run_workers(settings: RouterSettings, serve: Callable[[RouterSettings, socket.socket], None], backlog: int) -> int:
    """Fork `settings.workers` workers that each run `serve(settings, own socket)`; return the exit status."""
    holder = _bound(settings.host, settings.port, listen=None)  # holds the port; never listens
    port = holder.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    children: dict[int, int] = {}  # pid -> worker index
    stopping = False

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            status = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                holder.close()
                serve(settings, listening_socket(settings.host, port, backlog))
            except Exception:  # a worker reports and exits; the parent decides what follows
                log.exception("worker %d failed", index)
                status = 1
            finally:
                os._exit(status)
        children[pid] = index

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("router on %s:%d: %d workers (SO_REUSEPORT)", settings.host, port, settings.workers)
    for i in range(settings.workers):
        spawn(i)
    crashes: list[float] = []
    status = 0
    while children:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        index = children.pop(pid, None)
        if index is None or stopping:
            continue
        code = os.waitstatus_to_exitcode(raw)
        now = time.monotonic()
        crashes = [t for t in crashes if now - t < _CRASH_WINDOW_S] + [now]
        if len(crashes) > _CRASHES_ALLOWED:
            log.error(
                "worker %d exited (%d); %d exits within %g s: stopping", index, code, len(crashes), _CRASH_WINDOW_S
            )
            status = 1
            stop(signal.SIGTERM, None)
            continue
        log.warning("worker %d (pid %d) exited with %d; starting it again", index, pid, code)
        spawn(index)
    holder.close()
    return status

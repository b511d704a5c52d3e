"""`pdgate-router` / `python -m pdgate.router`: settings from env + flags, then uvicorn.

uvicorn picks uvloop when installed; HTTP is uvicorn's httptools protocol wrapped by `pdgate.serving`
(header and body timeouts, 413 on an over-long Content-Length before the body is read, a connection
cap). Both matter for the router's CPU per request (see bench/router.py). Settings that do not
validate (a bad instance URL, a secret file others can read) end the process with the reason, status 2.
`--workers N` runs N such processes on one port (`pdgate.router.workers`).

Why the server's imports wait until the settings are read: FastAPI, uvicorn, prometheus_client and the
app take seconds to import on a cold disk (10 s on a fresh machine), which `--help` and a settings error
do not need. `tests/deploy/test_cli_imports.py` keeps them out of the parser's path.

Why the heap is frozen before serving (`_freeze_startup_heap`): the imports and the app leave ~70k
objects for the cyclic collector, and under load a full collection comes every few thousand requests
(what the requests in flight hold when young collections run is promoted, and once a quarter of the
long-lived count was, a full one follows) and walks them all: ~50 ms each, ~20 us per request at
concurrency 32 in isolated mode, a tenth of the router's CPU (issue #25). Frozen, they are left out of
every collection; the startup's own garbage is collected first.
"""

from __future__ import annotations

import gc
import logging
import socket
import sys
from collections.abc import Sequence

from pdgate.router.settings import RouterSettings, claim_budget_problem, parse_cli
from pydantic import ValidationError

from pdgate.logs import configure_logging
from pdgate.settings import invalid_settings

__all__ = ["main"]


def _settings(argv: Sequence[str] | None) -> RouterSettings:
    try:
        return parse_cli(argv)
    except ValidationError as exc:
        print(f"pdgate-router: invalid settings: {invalid_settings(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


_SECRET_FLAGS = ("--admin-token", "--api-key", "--upstream-api-key", "--metaserver-token")


def _secrets_on_argv(argv: Sequence[str]) -> list[str]:
    """Secret flags given with their value on the command line, where `ps` shows them to every user."""
    return sorted({a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in _SECRET_FLAGS})


def main(argv: Sequence[str] | None = None) -> None:
    settings = _settings(argv)
    configure_logging(settings.log_level)
    exposed = _secrets_on_argv(sys.argv[1:] if argv is None else argv)
    if exposed:
        logging.getLogger("pdgate.router").warning(
            "%s given on the command line: every user of this host can read it (ps); use the environment "
            "(PDGATE_ROUTER_<NAME>) or the matching --*-file flag",
            ", ".join(exposed),
        )
    logging.getLogger("pdgate.router").info(
        "router on %s:%d; instances from %s%s; policies prefill=%s decode=%s",
        settings.host,
        settings.port,
        settings.metaserver or f"the embedded metaserver ({settings.store})",
        f" + {len(settings.prefill)} static prefill, {len(settings.decode)} static decode"
        if settings.prefill or settings.decode
        else "",
        settings.prefill_policy,
        settings.decode_policy,
    )
    from pdgate.router.workers import run_workers, workers_problem

    problem = workers_problem(settings) or _claim_budget(settings)
    if problem is not None:
        print(f"pdgate-router: invalid settings: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if settings.workers > 1:
        raise SystemExit(run_workers(settings, _serve, _BACKLOG))
    _serve(settings, None)


_BACKLOG = 4096


def _claim_budget(settings: RouterSettings) -> str | None:
    """The embedded metaserver's `max_claims` against `--decode-retries`; a separate metaserver's is its own
    setting, which the router cannot read, so it is named in the log."""
    if settings.embedded:
        from pdgate.router.app import embedded_meta_settings

        return claim_budget_problem(settings.decode_retries, embedded_meta_settings(settings).max_claims)
    logging.getLogger("pdgate.router").info(
        "--decode-retries %d: the metaserver's --max-claims must be above it (its default, 3, is)",
        settings.decode_retries,
    )
    return None


def _serve(settings: RouterSettings, sock: socket.socket | None) -> None:
    """One router process: on its own socket when a worker (`pdgate.router.workers`), else on host:port."""
    import uvicorn
    from pdgate.router.app import create_app, serving_protocol

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        log_config=None,
        loop="auto",
        http=serving_protocol(settings),
        backlog=_BACKLOG,
        timeout_keep_alive=30,
        proxy_headers=False,  # no X-Forwarded-* rewriting: saves a middleware on every request
    )
    _freeze_startup_heap()
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


def _freeze_startup_heap() -> None:
    """Keep what the imports and the app built out of every later collection (module doc)."""
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    main()

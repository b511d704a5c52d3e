"""`pdgate-router` / `python -m pdgate.router`: settings from env + flags, then uvicorn.

uvicorn picks uvloop and httptools when installed (uvicorn[standard]); both matter for the router's
CPU per request (see bench/router.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvicorn
from pdgate.router.app import create_app
from pdgate.router.logs import configure_logging
from pdgate.router.settings import parse_cli

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_cli(argv)
    configure_logging(settings.log_level)
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
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        log_config=None,
        loop="auto",
        http="auto",
        backlog=4096,
        timeout_keep_alive=30,
        proxy_headers=False,  # no X-Forwarded-* rewriting: saves a middleware on every request
    )


if __name__ == "__main__":
    main()

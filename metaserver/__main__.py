"""`pdgate-metaserver` / `python -m pdgate.metaserver`: settings from env + flags, then uvicorn.

uvicorn picks uvloop and httptools when they are installed (uvicorn[standard]); the app object is built
here from the settings, so one process serves one app (scale out with more processes on one Redis).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvicorn
from pdgate.metaserver.app import create_app
from pdgate.metaserver.logs import configure_logging
from pdgate.metaserver.settings import parse_cli

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_cli(argv)
    configure_logging(settings.log_level)
    store_kind = settings.store.split("://", 1)[0]
    logging.getLogger("pdgate.metaserver").info(
        "metaserver on %s:%d, store %s, auth %s",
        settings.host,
        settings.port,
        store_kind,
        "on" if settings.admin_token else "off",
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
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()

"""`pdgate-metaserver` / `python -m pdgate.metaserver`: settings from env + flags, then uvicorn.

The app object is built here from the settings, so one process serves one app (scale out with more
processes on one Redis). HTTP is uvicorn's httptools protocol wrapped by `pdgate.serving` (header and
body timeouts, early 413, a connection cap); uvloop is used when installed. Settings that do not validate
end the process with the reason, status 2, as the router does. The server's imports (FastAPI, uvicorn,
redis-py, prometheus_client) wait until the settings are read, so `--help` answers at once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from pdgate.metaserver.settings import parse_cli
from pydantic import ValidationError

from pdgate.logs import configure_logging
from pdgate.settings import invalid_settings

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = parse_cli(argv)
    except ValidationError as exc:  # the reason, status 2: the words of every pdgate command (pdgate.settings)
        print(f"pdgate-metaserver: invalid settings: {invalid_settings(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    import uvicorn
    from pdgate.metaserver.app import create_app, render_problem, server_limits

    from pdgate.serving import guarded_protocol

    configure_logging(settings.log_level)
    store_kind = settings.store.split("://", 1)[0]
    # The app's lifespan logs who may use the /v1 routes (protected mode or admin token).
    logging.getLogger("pdgate.metaserver").info(
        "metaserver on %s:%d, store %s", settings.host, settings.port, store_kind
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        log_config=None,
        loop="auto",
        http=guarded_protocol(server_limits(settings), render_problem),
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()

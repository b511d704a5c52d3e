#!/usr/bin/env python3
"""Container healthcheck: exit 0 when GET URL answers 2xx within the timeout, 1 otherwise.

The slim images have no curl; Python is there in every one of them. The URL is the first argument,
else $PDGATE_HEALTHCHECK_URL, else /health on the port the service's own settings name: PDGATE_ROUTER_PORT
for the router, PDGATE_METASERVER_PORT for the metaserver (or its older name PDGATE_PORT, which the
metaserver still reads; the new name wins there too), else 8300.

usage: pdgate-healthcheck [URL] [--timeout SECONDS]
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def default_url(env: dict[str, str]) -> str:
    """The URL to probe when none is given: the container's own service port, from its environment."""
    if env.get("PDGATE_HEALTHCHECK_URL"):
        return env["PDGATE_HEALTHCHECK_URL"]
    # The metaserver's own order (metaserver/settings.py): the new name first, then the older one.
    port = env.get("PDGATE_ROUTER_PORT") or env.get("PDGATE_METASERVER_PORT") or env.get("PDGATE_PORT") or "8300"
    return f"http://127.0.0.1:{port}/health"


def main(argv: list[str]) -> int:
    timeout = 3.0
    args = list(argv)
    if "--timeout" in args:
        i = args.index("--timeout")
        timeout = float(args[i + 1])
        del args[i : i + 2]
    url = args[0] if args else default_url(dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            ok = 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}")
        return 1
    if not ok:
        print(f"unhealthy: {url}: HTTP {resp.status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

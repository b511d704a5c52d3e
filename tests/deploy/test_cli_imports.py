"""`pdgate-router --help` and `pdgate-metaserver --help` must not import the server (issue #26: 10 s each
on a fresh machine, spent importing FastAPI, uvicorn and prometheus_client before the parser was built).

No timing is asserted: a fresh interpreter runs `--help` and reports which heavy modules it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("fastapi", "starlette", "uvicorn", "prometheus_client", "redis", "pdgate.router.app", "pdgate.metaserver.app")

_PROBE = """
import contextlib, io, json, sys
from {module} import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["--help"])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "help": out.getvalue(), "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


@pytest.mark.parametrize(
    ("module", "flag"),
    [("pdgate.router.__main__", "--admin-token"), ("pdgate.metaserver.__main__", "--store")],
)
def test_help_imports_no_server(module: str, flag: str) -> None:
    probe = _PROBE.format(module=module, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    assert flag in result["help"]  # the whole parser was built
    assert result["heavy"] == []


def test_server_modules_still_load_when_serving() -> None:
    """The deferred imports name modules that exist (a typo would only show when a user starts a server)."""
    probe = (
        "import pdgate.router.__main__ as r, pdgate.metaserver.__main__ as m, inspect, sys\n"
        "import uvicorn, pdgate.router.app, pdgate.router.workers, pdgate.metaserver.app, pdgate.serving\n"
        "assert pdgate.router.app.create_app and pdgate.router.app.serving_protocol\n"
        "assert pdgate.metaserver.app.render_problem and pdgate.metaserver.app.server_limits\n"
        "assert pdgate.router.workers.run_workers and pdgate.router.workers.workers_problem\n"
    )
    subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)

"""Real deployments for the `pdgate` command's tests: a router (embedded metaserver) or a standalone
metaserver, with pdgate-sim engines, over sockets; the command runs in-process through `main(argv)`
(its exit status and what it printed), as an operator's shell would run it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pdgate.cli.main import main
from pdgate.metaserver.app import create_app
from pdgate.metaserver.settings import MetaSettings

from tests.integration.router.conftest import Deployment
from tests.support.servers import UvicornThread

TOKEN = "cli-admin-token-0123456789"


def pdgate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `pdgate argv...`: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def metaserver(host: str = "127.0.0.1", **fields: Any) -> UvicornThread:
    """A standalone metaserver (memory store unless `store` is given) on a free port of `host`."""
    settings = MetaSettings(**{"admin_token": TOKEN, "log_level": "warning", **fields})
    return UvicornThread(create_app(settings), host=host).start()


@pytest.fixture(scope="module")
def stack() -> Iterator[Deployment]:
    """A router with the embedded metaserver, one prefill and one decode sim, an admin token."""
    with Deployment(admin_token=TOKEN) as dep:
        p, d = dep.add_many([("prefill", ()), ("decode", ())])
        dep.wait_available(p.id, d.id)
        yield dep


@pytest.fixture(autouse=True)
def _no_cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """No PDGATE_CLI_* of the caller's shell, and no config file of the caller's: each test says its own."""
    import os

    for name in list(os.environ):
        if name.startswith("PDGATE_CLI_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))

"""Client credentials never reach engines by default, and every key is checked (issue 9).

Before, with no --api-key set, the client's `Authorization` header went to the prefill and the decode:
any engine (or anyone who registered one) collected every client's key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pdgate.router.settings import RouterSettings, parse_cli

from tests.integration.router.conftest import Deployment
from tests.security.router_support import RecordingEngine
from tests.support.ports import wait_until


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    with RecordingEngine("both") as e:
        yield e


def _auth_seen(engine: RecordingEngine) -> set[bytes | None]:
    return {h.get(b"authorization") for h in engine.seen}


def _serve(engine: RecordingEngine, **settings: Any) -> Deployment:
    return Deployment(prefill=[engine.url], decode=[engine.url], **settings)


def _ask(d: Deployment, key: str) -> None:
    wait_until(lambda: d.health()["status"] == "ok", timeout=20, what="the static engine")
    got = d.openai(api_key=key).chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert got.choices[0].message.content


def test_the_clients_key_is_not_forwarded_by_default(engine: RecordingEngine) -> None:
    with _serve(engine) as d:
        _ask(d, "sk-client-secret")
    assert len(engine.seen) == 2 and _auth_seen(engine) == {None}


def test_engines_get_the_upstream_key_only(engine: RecordingEngine, tmp_path: Path) -> None:
    key_file = tmp_path / "upstream"
    key_file.write_text("engine-key\n")
    key_file.chmod(0o600)
    with _serve(engine, upstream_api_key_file=str(key_file), api_key=["sk-client-secret"]) as d:
        _ask(d, "sk-client-secret")
    assert _auth_seen(engine) == {b"Bearer engine-key"}


def test_forwarding_the_clients_key_is_an_explicit_opt_in(engine: RecordingEngine) -> None:
    with _serve(engine, forward_client_auth=True) as d:
        _ask(d, "sk-client-secret")
    assert _auth_seen(engine) == {b"Bearer sk-client-secret"}


def test_api_key_file_guards_the_openai_routes(engine: RecordingEngine, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-one\nkey-two\n")
    keys.chmod(0o600)
    with _serve(engine, api_key_file=str(keys)) as d:
        _ask(d, "key-two")
        with pytest.raises(openai.AuthenticationError):
            d.openai(api_key="key-three").models.list()
        with pytest.raises(openai.AuthenticationError):
            d.openai(api_key="key-on").models.list()  # a prefix of a key is not the key
        assert [m.id for m in d.openai(api_key="key-one").models.list().data] == ["sim-model"]


def test_secret_flags_have_file_twins_and_env_vars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = {a.dest for a in __import__("pdgate.router.settings", fromlist=["x"]).build_parser()._actions}
    for secret in ("admin_token", "api_key", "upstream_api_key", "metaserver_token"):
        assert f"{secret}_file" in names
    monkeypatch.setenv("PDGATE_ROUTER_UPSTREAM_API_KEY", "from-env")
    assert parse_cli([]).upstream_api_key == "from-env"
    both = tmp_path / "k"
    both.write_text("x")
    both.chmod(0o600)
    with pytest.raises(ValueError, match="both set"):
        RouterSettings(upstream_api_key="a", upstream_api_key_file=str(both))

"""The Redis scripts are loaded with the ledger's table as data, so Lua names no rule of its own."""

from __future__ import annotations

import pytest
from pdgate.metaserver import ledger, registry
from pdgate.metaserver.store.base import LedgerPolicy
from pdgate.metaserver.store.keys import Keys
from pdgate.metaserver.store.scripts import SCRIPTS, config, lua_literal, source


def test_every_move_and_lapse_reaches_the_scripts() -> None:
    cfg = config(Keys("t"), LedgerPolicy(max_claims=4))
    assert set(cfg["moves"]) == set(ledger.MOVES) and cfg["lapses"] == ledger.LAPSES
    assert cfg["kept"] == registry.KEPT_ON_REREGISTER and cfg["max_claims"] == 4
    claim = cfg["moves"]["claim"]
    assert (claim["sources"], claim["to"], claim["claimant"]) == ({ledger.S.READY}, ledger.S.CLAIMED, "take")


def test_lua_literal_renders_plain_data() -> None:
    move = ledger.MOVES["expire"]
    rendered = lua_literal({"sources": move.sources, "reason": move.reason, "n": 3, "on": True, "none": None})
    assert rendered == (
        "{['sources'] = {['CLAIMED'] = true, ['PENDING'] = true, ['READY'] = true}, "
        "['reason'] = '%s lease lapsed', ['n'] = 3, ['on'] = true, ['none'] = nil}"
    )
    assert lua_literal(("a", "b")) == "{'a', 'b'}"


@pytest.mark.parametrize("bad", ["it's", "a\\b", "line\nbreak", "]]"])
def test_lua_literal_refuses_what_could_escape_a_string(bad: str) -> None:
    with pytest.raises(ValueError):
        lua_literal(bad)


def test_each_script_starts_with_its_config_then_the_library() -> None:
    cfg = config(Keys(), LedgerPolicy())
    for name in SCRIPTS:
        src = source(name, cfg)
        assert src.startswith("local CFG = {") and "local function apply_move(" in src

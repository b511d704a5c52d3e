"""The error vocabulary (`pdgate.errors`): each code carries its own meaning, looked up by its string."""

from __future__ import annotations

import orjson

from pdgate.errors import CODES, Code, CodeInfo, PDGateError, info


def test_every_code_carries_its_entry_and_the_table_agrees() -> None:
    assert set(CODES) == set(Code)
    for code in Code:
        assert isinstance(code.entry, CodeInfo)
        assert CODES[code] is code.entry
        assert Code(code.value) is code  # what crossed a wire as a string reads back as the member


def test_client_faults_are_4xx_and_never_retryable_elsewhere() -> None:
    for code in Code:
        if code.entry.openai_type == "invalid_request_error":
            assert 400 <= code.entry.status < 500 or code is Code.LOOP_DETECTED, code
            assert not code.entry.retryable, code


def test_an_unknown_code_from_a_newer_peer_reads_as_internal() -> None:
    assert info("pd_from_the_future") == Code.INTERNAL.entry
    assert info(Code.OVERLOADED).status == 429


def test_codes_serialize_as_their_strings() -> None:
    assert orjson.dumps({"code": Code.KV_EXPIRED}) == b'{"code":"pd_kv_expired"}'
    err = PDGateError("gone", code=Code.KV_EXPIRED)
    assert (err.status, err.retryable, err.openai_type) == (504, False, "server_error")

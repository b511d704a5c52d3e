"""bodies.py's `SplicedBody.fan_out`: what the prompts of a fan-out share is encoded once for all of them.

Why (issue #21, finding 3): with 64 prompts and one 4 MB field the body was encoded again for every
prompt, and the router's memory grew by 776 MB. The test counts the encodings that hold the big field
(orjson is the only encoder `bodies` uses): one for the whole fan-out, every hop of every prompt
included, where one `SplicedBody` per prompt (the old way, shown for contrast) makes 64."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from pdgate.router.bodies import SplicedBody

PROMPTS = 64
BIG = "x" * (4 << 20)
KV = {"transfer_id": "pd-1", "remote_block_ids": [[1, 2]]}


def fan_out_body() -> dict[str, Any]:
    return {"model": "m", "prompt": [f"prompt {i}" for i in range(PROMPTS)], "max_tokens": 4, "user_notes": BIG}


@pytest.fixture
def big_encodings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of the orjson encodings made while the test runs that are at least as large as `BIG`."""
    real = orjson.dumps
    seen: list[int] = []

    def counting(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        out = real(obj, *args, **kwargs)
        if len(out) >= len(BIG):
            seen.append(len(out))
        return out

    monkeypatch.setattr(orjson, "dumps", counting)
    yield seen


def test_the_big_field_is_encoded_once_for_every_hop_of_every_prompt(big_encodings: list[int]) -> None:
    body = fan_out_body()
    spliced = SplicedBody.fan_out(body, body["prompt"])
    payloads = [(s.prefill(KV), s.decode(KV)) for s in spliced]
    assert len(big_encodings) == 1, big_encodings
    assert len(payloads) == PROMPTS
    for i in (0, PROMPTS - 1):  # and each is still the payload its own prompt would have had
        alone = SplicedBody({**body, "prompt": body["prompt"][i]})
        assert orjson.loads(payloads[i][0]) == orjson.loads(alone.prefill(KV))
        assert orjson.loads(payloads[i][1]) == orjson.loads(alone.decode(KV))


def test_one_spliced_body_per_prompt_encodes_it_per_prompt(big_encodings: list[int]) -> None:
    """The contrast: what `fan_out` replaces costs one encoding of the big field per prompt."""
    body = fan_out_body()
    _ = [SplicedBody({**body, "prompt": p}) for p in body["prompt"]]
    assert len(big_encodings) == PROMPTS

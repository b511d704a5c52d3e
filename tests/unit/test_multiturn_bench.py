"""bench/multiturn.py's pure parts: the decode log's loads by request id, the share of a full prompt moved
per turn, and the W4 targets against round robin in the same run."""

from __future__ import annotations

from bench.multiturn_report import Turn, loaded_tokens, summarize, table, targets

LOG = """\
(pdgate) INFO 01:13:41,175 [pdgate.connector.decode_recv] transfer pd-aa: cmpl-pd-aa-0-ba loaded 831 tokens in 27.3 ms
(pdgate) INFO 01:13:42,175 [pdgate.connector.decode_recv] transfer pd-bb: cmpl-pd-bb-0-cc loaded 320 tokens in 9.1 ms
"""


def test_loads_are_read_by_request_id() -> None:
    assert loaded_tokens([LOG, ""]) == {"pd-aa": 831, "pd-bb": 320}


def turn(n: int, prompt: int, ttft: float, loaded: int | None, path: str = "pd") -> Turn:
    return Turn(prompt, ttft, 64, f"r{n}", path, turn=n, loaded=loaded)


def test_summary_and_targets() -> None:
    rr = [turn(1, 832, 0.2, 831), turn(2, 1216, 0.4, 1215), turn(3, 1600, 0.6, 1599)]
    kv = [turn(1, 832, 0.2, 831), turn(2, 1216, 0.1, 384), turn(3, 1600, 0.1, None, "whole")]
    s = summarize(kv)
    assert s["ttft_p50_ms"] == 100 and s["failed"] == 0 and s["paths"] == {"pd": 2, "whole": 1}
    assert abs(s["moved_share_turns_2plus"] - (384 / 1215) / 2) < 1e-9  # whole moved nothing
    assert summarize(rr)["moved_share"] == 1.0
    doc = {"setups": {"round-robin": {"summary": summarize(rr)}, "kv-events": {"summary": s}}}
    met = {what.split(" ")[0]: ok for what, _, ok in targets(doc)}
    assert met == {"TTFT": True, "KV": True}  # 100/400 ms; turns 2+ moved (0.32 + 0) / 2 of a full prompt
    assert "**no**" not in table(doc)
    # Later turns that move most of their prompt (the decode held nothing of it) miss the target.
    worse = [turn(1, 832, 0.2, 831), turn(2, 1216, 0.1, 1000), turn(3, 1600, 0.1, 384)]
    doc["setups"]["kv-events"]["summary"] = summarize(worse)
    met = {what.split(" ")[0]: ok for what, _, ok in targets(doc)}
    assert met == {"TTFT": True, "KV": False}  # (0.82 + 0.24) / 2 > 0.3
    assert "**no**" in table(doc)
    # With the conditional decider too: its own TTFT row, judged on its own.
    slow = [turn(1, 832, 0.5, None, "whole"), turn(2, 1216, 0.3, None, "whole"), turn(3, 1600, 0.4, None, "whole")]
    doc["setups"]["kv-conditional"] = {"summary": summarize(slow)}
    rows = {what: (got, ok) for what, got, ok in targets(doc)}
    got, ok = rows["TTFT p50 with KV events and the conditional decider <= 0.6x round-robin PD"]
    assert got == "400 / 400 ms = 1.00x" and ok is False
    assert rows["TTFT p50 with KV events <= 0.6x round-robin PD"][1] is True


def test_a_failed_request_is_counted_and_left_out_of_the_latencies() -> None:
    bad = Turn(832, None, 3, "r9", "pd", "3 tokens", turn=1)
    s = summarize([bad, turn(1, 832, 0.3, 831)])
    assert s["failed"] == 1 and s["ttft_p50_ms"] == 300

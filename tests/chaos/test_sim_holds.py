"""pdgate-sim's held-blocks counter, which the chaos suite's "held blocks" column relies on.

A counter that never moved would pass every chaos row, so this proves it moves both ways, against a
real metaserver process and a real pdgate-sim process: a prefill holds blocks from READY, frees them when
the ledger says DONE (event feed), and frees them when the record is lost (a store that restarted empty).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port, wait_until

pytestmark = pytest.mark.chaos

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from chaos_stack import BIN, SIM_ENV, TOKEN, Procs, sim_stats, wait_ready  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
READY_LEASE_S = 5.0


class Pair:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.meta_port = free_port()
        self.meta_url = f"http://127.0.0.1:{self.meta_port}"
        self.meta = self.start_meta()
        port = free_port()
        self.sim_url = f"http://127.0.0.1:{port}"
        argv = [str(BIN / "pdgate-sim"), "--role", "prefill", "--port", str(port), "--instance-id", "p0"]
        argv += ["--metaserver", self.meta_url, "--lease-s", "2"]
        self.sim = procs.start("sim", argv, url=self.sim_url, port=port, env=SIM_ENV)
        wait_ready(self.sim_url, proc=self.sim)

    def start_meta(self) -> object:
        argv = [str(BIN / "pdgate-metaserver"), "--port", str(self.meta_port)]
        argv += ["--ready-lease-s", str(READY_LEASE_S), "--log-level", "warning"]
        proc = self.procs.start("metaserver", argv, port=self.meta_port, env={"PDGATE_ADMIN_TOKEN": TOKEN})
        wait_ready(self.meta_url, proc=proc)
        return proc

    def prefill(self, tid: str) -> None:
        """What the router does: create the PENDING handoff, then ask the prefill with do_remote_decode."""
        body = {"prefill_instance_id": "p0", "transfer_id": tid}
        r = httpx.post(f"{self.meta_url}/v1/handoffs", json=body, headers=AUTH, timeout=5)
        assert r.status_code in (200, 201), r.text
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "metaserver": self.meta_url}
        prompt = "one two three " * 20
        body2 = {"model": "sim-model", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}
        r = httpx.post(f"{self.sim_url}/v1/completions", json=body2, timeout=5)
        assert r.status_code == 200, r.text

    def held(self) -> int:
        st = sim_stats(self.sim_url)
        assert st is not None and "held_blocks" in st, st
        return int(st["held_blocks"])


@pytest.fixture
def pair() -> Iterator[Pair]:
    procs = Procs()
    try:
        yield Pair(procs)
    finally:
        procs.close()


def test_held_from_ready_until_done(pair: Pair) -> None:
    pair.prefill("t-done")
    assert pair.held() > 0
    r = httpx.post(f"{pair.meta_url}/v1/handoffs/t-done/claim", json={"decode_instance_id": "d0"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert pair.held() > 0  # a claim is not the end: the decode is still reading
    r = httpx.post(f"{pair.meta_url}/v1/handoffs/t-done/done", json={"decode_instance_id": "d0"}, headers=AUTH)
    assert r.status_code == 200, r.text
    wait_until(lambda: pair.held() == 0, timeout=5, what="blocks freed on the DONE event")
    assert (sim_stats(pair.sim_url) or {})["freed"] == {"event": 1}


def test_record_lost_with_the_store_is_freed(pair: Pair) -> None:
    pair.prefill("t-lost")
    assert pair.held() > 0
    pair.meta.kill()  # type: ignore[attr-defined]
    pair.meta = pair.start_meta()  # memory store: every record is gone, as after a Redis restart without AOF
    t0 = time.monotonic()
    wait_until(lambda: pair.held() == 0, timeout=READY_LEASE_S + 10, what="blocks freed once the record is missing")
    assert time.monotonic() - t0 < READY_LEASE_S + 2  # within the READY lease plus a check or two
    assert (sim_stats(pair.sim_url) or {})["freed"] == {"record_lost": 1}

"""Pure parts of the transport seam: coalescing, validation, regions, the error tree."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pdgate.connector.transport import transport_class
from pdgate.connector.transport.base import (
    UINT64_MAX,
    BlockRun,
    ByteRange,
    KVRegion,
    PullRequest,
    PullResult,
    Transport,
    byte_ranges,
    check_layouts_match,
    check_pull,
    coalesce,
    regions_from_address,
)
from pdgate.connector.transport.errors import (
    EngineError,
    InvalidPull,
    LinkError,
    PeerUnreachable,
    PullTimeout,
    RegistrationError,
    RemoteKVMissing,
    TransportClosed,
    TransportError,
)

REPO = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------- coalesce


def expand(runs: list[BlockRun]) -> list[tuple[int, int]]:
    return [(r.src_start + k, r.dst_start + k) for r in runs for k in range(r.count)]


def test_coalesce_merges_runs_adjacent_on_both_sides() -> None:
    assert coalesce([4, 5, 6, 9], [10, 11, 12, 2]) == [BlockRun(4, 10, 3), BlockRun(9, 2, 1)]


def test_coalesce_keeps_pairs_adjacent_on_one_side_only() -> None:
    assert coalesce([1, 2, 3], [7, 9, 10]) == [BlockRun(1, 7, 1), BlockRun(2, 9, 2)]
    assert coalesce([3, 2, 1], [3, 2, 1]) == [BlockRun(3, 3, 1), BlockRun(2, 2, 1), BlockRun(1, 1, 1)]


def test_coalesce_edge_cases() -> None:
    assert coalesce([], []) == []
    assert coalesce([5], [0]) == [BlockRun(5, 0, 1)]
    assert coalesce(range(100), range(50, 150)) == [BlockRun(0, 50, 100)]
    with pytest.raises(InvalidPull, match="2 source ids vs 1"):
        coalesce([1, 2], [3])


def test_coalesce_is_lossless_and_minimal_on_random_input() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(1, 60)
        src = sorted(rng.sample(range(200), n)) if rng.random() < 0.5 else rng.sample(range(200), n)
        dst = sorted(rng.sample(range(200), n)) if rng.random() < 0.5 else rng.sample(range(200), n)
        runs = coalesce(src, dst)
        assert expand(runs) == list(zip(src, dst, strict=True))
        for a, b in itertools.pairwise(runs):  # no two neighbouring runs could have merged
            assert not (b.src_start == a.src_start + a.count and b.dst_start == a.dst_start + a.count)


def test_scattered_permutations_do_not_merge() -> None:
    rng = random.Random(7)
    src, dst = list(range(4096)), list(range(4096))
    rng.shuffle(src)
    rng.shuffle(dst)
    assert len(coalesce(src, dst)) > 4000


# ---------------------------------------------------------------- byte ranges


def test_byte_ranges_dense_regions_give_one_range_per_run() -> None:
    src = KVRegion.dense("k", 0x10000, 256, 64)
    dst = KVRegion.dense("k", 0x90000, 256, 32)
    assert byte_ranges(coalesce([4, 5, 6, 9], [0, 1, 2, 7]), src, dst) == [
        ByteRange(0x10000 + 4 * 256, 0x90000, 3 * 256),
        ByteRange(0x10000 + 9 * 256, 0x90000 + 7 * 256, 256),
    ]


def test_byte_ranges_strided_region_splits_runs_into_blocks() -> None:
    src = KVRegion("k", 0x10000, 256, 64, 512)  # K and V interleaved: K blocks are 512 B apart
    dst = KVRegion.dense("k", 0x90000, 256, 32)
    assert byte_ranges([BlockRun(2, 0, 2)], src, dst) == [
        ByteRange(0x10000 + 2 * 512, 0x90000, 256),
        ByteRange(0x10000 + 3 * 512, 0x90000 + 256, 256),
    ]


def test_byte_ranges_need_equal_block_len() -> None:
    with pytest.raises(InvalidPull, match="block_len differs"):
        byte_ranges([], KVRegion.dense("k", 1, 256, 4), KVRegion.dense("k", 1, 128, 4))


# ---------------------------------------------------------------- regions


def test_region_geometry_and_round_trip() -> None:
    r = KVRegion("layer3.v", 0x1000, 100, 10, 300)
    assert r.extent == 9 * 300 + 100
    assert r.block_addr(4) == 0x1000 + 1200
    assert not r.is_dense and KVRegion.dense("x", 8, 4, 2).is_dense
    assert KVRegion.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "name"),
        ({"base_ptr": 0}, "base_ptr"),
        ({"block_len": -1}, "block_len"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"stride": 50}, "stride 50 is smaller than block_len 100"),
        ({"num_blocks": 2.0}, "num_blocks"),
        ({"base_ptr": True}, "base_ptr"),
    ],
)
def test_region_validation(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"name": "k", "base_ptr": 4096, "block_len": 100, "num_blocks": 8, "stride": 100}
    with pytest.raises(RegistrationError, match=match):
        KVRegion(**{**base, **kwargs})  # type: ignore[arg-type]


def test_regions_from_address() -> None:
    regions = [KVRegion.dense("k", 4096, 64, 8), KVRegion.dense("v", 8192, 64, 8)]
    assert regions_from_address({"regions": [r.to_dict() for r in regions]}) == regions
    with pytest.raises(InvalidPull, match="no 'regions'"):
        regions_from_address({"kind": "nixl"})
    with pytest.raises(InvalidPull, match="lacks 'stride'"):
        regions_from_address({"regions": [{"name": "k", "base_ptr": 1, "block_len": 1, "num_blocks": 1}]})
    with pytest.raises(InvalidPull, match="invalid"):
        regions_from_address({"regions": [dict(regions[0].to_dict(), block_len=0)]})


def test_layouts_must_match_in_count_names_and_block_len() -> None:
    local = [KVRegion.dense("k", 4096, 64, 8), KVRegion.dense("v", 8192, 64, 8)]
    check_layouts_match(local, [KVRegion("k", 1, 64, 100, 128), KVRegion("v", 2, 64, 100, 64)])
    with pytest.raises(InvalidPull, match="1 regions, we registered 2"):
        check_layouts_match(local, local[:1])
    with pytest.raises(InvalidPull, match="region 1 differs"):
        check_layouts_match(local, [local[0], KVRegion.dense("w", 8192, 64, 8)])
    with pytest.raises(InvalidPull, match="region 0 differs"):
        check_layouts_match(local, [KVRegion.dense("k", 4096, 32, 8), local[1]])


# ---------------------------------------------------------------- pull validation


def req(src: list[object], dst: list[object], **kw: object) -> PullRequest:
    base: dict[str, object] = {"transfer_id": "t1", "kv_key": 42, "remote": {}, "timeout_s": None}
    base.update(kw)
    return PullRequest(remote_block_ids=src, local_block_ids=dst, **base)  # type: ignore[arg-type]


def test_valid_pull_passes_and_repeated_sources_are_allowed() -> None:
    check_pull(req([0, 7, 7], [1, 2, 3]), local_num_blocks=4, remote_num_blocks=8)
    check_pull(req([0], [0], kv_key=UINT64_MAX), local_num_blocks=1, remote_num_blocks=1)


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (req([0, 1], [0]), "remote_block_ids has 2 ids but local_block_ids has 1"),
        (req([], []), "empty pull"),
        (req([8], [0]), r"remote_block_ids\[0\] = 8 is out of range \[0, 8\)"),
        (req([0, -1], [0, 1]), r"remote_block_ids\[1\] = -1 is out of range"),
        (req([0], [4]), r"local_block_ids\[0\] = 4 is out of range \[0, 4\)"),
        (req([0.0], [0]), r"remote_block_ids\[0\] = 0.0 is not an int"),
        (req([0], [True]), r"local_block_ids\[0\] = True is not an int"),
        (req([0], ["1"]), "is not an int"),
        (req([0, 1, 2], [3, 1, 3]), r"local_block_ids\[2\] = 3 appears twice"),
        (req([0], [0], kv_key=-1), "kv_key"),
        (req([0], [0], kv_key=2**64), "kv_key"),
        (req([0], [0], kv_key=True), "kv_key"),
        (req([0], [0], kv_key="7"), "kv_key"),
        (req([0], [0], transfer_id=""), "transfer_id"),
        (req([0], [0], timeout_s=0), "timeout_s"),
    ],
)
def test_invalid_pulls_are_bad_requests(request_: PullRequest, match: str) -> None:
    with pytest.raises(InvalidPull, match=match):
        check_pull(request_, local_num_blocks=4, remote_num_blocks=8)


def test_pull_request_freezes_its_id_lists() -> None:
    src, dst = [1, 2], [3, 4]
    r = PullRequest("t", 1, {}, src, dst)
    src.append(9)
    assert r.remote_block_ids == (1, 2) and r.local_block_ids == (3, 4)


# ---------------------------------------------------------------- errors and results


ERRORS = [
    (InvalidPull, "transport_bad_request", False),
    (RegistrationError, "transport_registration_failed", False),
    (TransportClosed, "transport_closed", False),
    (RemoteKVMissing, "transport_remote_kv_missing", False),
    (EngineError, "transport_engine_error", False),
    (PeerUnreachable, "transport_peer_unreachable", True),
    (LinkError, "transport_link_failed", True),
    (PullTimeout, "transport_pull_timeout", True),
]


@pytest.mark.parametrize(("cls", "code", "retryable"), ERRORS)
def test_error_tree(cls: type[TransportError], code: str, retryable: bool) -> None:
    err = cls("it broke", engine_code="LLM_LINK_FAILED")
    assert isinstance(err, TransportError)
    assert (err.code, err.retryable, err.message) == (code, retryable, "it broke")
    assert str(err) == f"{code}: it broke [LLM_LINK_FAILED]"
    assert str(cls("plain")) == f"{code}: plain"


def test_error_codes_are_unique() -> None:
    codes = [code for _, code, _ in ERRORS] + [TransportError.code]
    assert len(set(codes)) == len(codes)


def test_pull_result_constructors() -> None:
    ok = PullResult.success("t", nbytes=10, elapsed_s=0.5)
    assert ok.ok and ok.error is None and ok.nbytes == 10
    bad = PullResult.failure("t", PullTimeout("slow"))
    assert not bad.ok and isinstance(bad.error, PullTimeout) and bad.nbytes == 0


class _Bare(Transport):
    """The least an engine writes: the frame (checks, address, close) is the base's."""

    kind = "bare"

    def __init__(self) -> None:
        self.closes = 0

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._check_registration(regions)
        self._regions = tuple(regions)

    def _address(self) -> dict[str, Any]:
        return {"who": "me"}

    def start_pull(self, req: PullRequest) -> None:
        self._admit_pull(req)

    def poll(self) -> list[PullResult]:
        return []

    def _close_engine(self) -> None:
        self.closes += 1


def test_the_base_frames_every_transports_registration_address_pull_and_close() -> None:
    t = _Bare()
    region = KVRegion.dense("l0", 4096, 64, 8)
    with pytest.raises(RegistrationError, match="before register"):
        t.local_address()
    with pytest.raises(InvalidPull, match="before register"):
        t.start_pull(PullRequest("t", 1, {"kind": "bare"}, [0], [0]))
    with pytest.raises(RegistrationError, match="duplicate region names"):
        t.register([region, region])
    t.register([region])
    with pytest.raises(RegistrationError, match="already called"):
        t.register([region])
    address = t.local_address()
    assert address == {"kind": "bare", "who": "me", "regions": [region.to_dict()]}
    t.start_pull(PullRequest("t", 1, address, [7], [0]))  # a peer of our kind and layout
    with pytest.raises(InvalidPull, match="of kind 'other'"):
        t.start_pull(PullRequest("t", 1, address | {"kind": "other"}, [7], [0]))
    with pytest.raises(InvalidPull, match="out of range"):
        t.start_pull(PullRequest("t", 1, address, [8], [0]))
    t.close()
    t.close()
    assert t.closes == 1  # idempotent: the engine is released once
    with pytest.raises(TransportClosed, match="bare transport is closed"):
        t.start_pull(PullRequest("t", 1, address, [7], [0]))


def test_transport_class_imports_lazily_by_kind() -> None:
    assert transport_class("nixl").kind == "nixl"
    assert transport_class("llmdatadist").kind == "llmdatadist"
    with pytest.raises(ValueError, match="unknown transport kind 'tcp'"):
        transport_class("tcp")


def test_engine_modules_import_without_their_engines() -> None:
    # vLLM imports the connector in API-server processes too: importing the adapters must not
    # need nixl or CANN; only constructing a transport does.
    code = (
        "import sys; sys.modules['nixl'] = None; sys.modules['llm_datadist'] = None\n"
        "import connector.transport.nixl as n, connector.transport.llmdatadist as l\n"
        "try:\n    n.NixlTransport(ucx_net_devices='lo')\nexcept ImportError:\n    print('lazy-ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "lazy-ok" in res.stdout

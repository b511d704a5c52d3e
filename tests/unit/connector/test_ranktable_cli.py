"""pdgate-ranktable: generate a table from host lists, validate files (exit codes, messages)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdgate.connector.errors import RankTableError
from pdgate.connector.ranktable import GroupRole, assign_ranks, dump_rank_table
from pdgate.connector.ranktable_cli import HostSpec, generate, main, parse_host_spec
from pdgate.connector.ranktable_parse import load_rank_table, parse_rank_table

from tests.unit.connector.test_ranktable import _dev, a2_table, mutate

REPO = Path(__file__).resolve().parents[3]


def test_generate_round_trip_and_ranks() -> None:
    table = generate(
        [parse_host_spec("10.0.0.1:192.168.1.1,192.168.1.2"), parse_host_spec("10.0.0.2:3=192.168.2.4")],
        [parse_host_spec("10.0.0.3:192.168.3.1")],
        router="10.0.0.9",
    )
    again = parse_rank_table(json.loads(json.dumps(dump_rank_table(table))))
    assert again == table
    placements = assign_ranks(again, prefill_tp=1, decode_tp=1)
    assert [(p.server_id, p.device_id, p.rank_id, p.cluster_id) for p in placements] == [
        ("10.0.0.1", 0, 0, 0),
        ("10.0.0.1", 1, 1, 1),
        ("10.0.0.2", 3, 2, 2),
        ("10.0.0.3", 0, 0, 3),
    ]


def test_generate_a3_with_super_pods() -> None:
    table = generate(
        [parse_host_spec("10.0.0.1:192.168.1.1/10,192.168.1.2/11"), parse_host_spec("10.0.0.2:192.168.2.1/10")],
        [parse_host_spec("10.0.0.3:192.168.3.1/20")],
        a3=True,
        super_pods={"7": ["10.0.0.1", "10.0.0.3"], "8": ["10.0.0.2"]},
    )
    assert table.is_a3 and table.router is None
    pods = {p.super_pod_id: p.server_ids for p in table.group(GroupRole.PREFILL).super_pods}  # type: ignore[union-attr]
    assert pods == {"7": ("10.0.0.1",), "8": ("10.0.0.2",)}
    assert parse_rank_table(dump_rank_table(table)) == table


def test_generate_rejects_what_parse_rejects() -> None:
    with pytest.raises(RankTableError, match="also used by"):
        generate(
            [HostSpec("10.0.0.1", ((0, "192.168.1.1", None),))], [HostSpec("10.0.0.2", ((0, "192.168.1.1", None),))]
        )
    with pytest.raises(RankTableError, match="super_device_id: missing"):
        generate([parse_host_spec("10.0.0.1:192.168.1.1")], [parse_host_spec("10.0.0.2:192.168.1.2/1")], a3=True)


def test_generate_rejects_super_pods_naming_unknown_hosts() -> None:
    with pytest.raises(RankTableError, match=r"unknown host '10\.0\.0\.7'"):
        generate(
            [parse_host_spec("10.0.0.1:192.168.1.1/1")],
            [parse_host_spec("10.0.0.2:192.168.1.2/2")],
            a3=True,
            super_pods={"0": ["10.0.0.1", "10.0.0.2", "10.0.0.7"]},
        )


@pytest.mark.parametrize("bad", ["10.0.0.1", "10.0.0.1:", "10.0.0.1:x=1.2.3.4", "10.0.0.1:1.2.3.4/z"])
def test_host_spec_syntax(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_host_spec(bad)


# ---------------------------------------------------------------- CLI


def test_the_console_script_is_the_cli_module() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'pdgate-ranktable = "pdgate.connector.ranktable_cli:main"' in text
    assert main(["generate", "--prefill", "10.0.0.1:1.1.1.1", "--decode", "10.0.0.2:1.1.1.2"]) == 0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdgate.connector.ranktable_cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_validate_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(a2_table()))
    res = run_cli("validate", str(good), "--prefill-tp", "2", "--show")
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout and "cluster_id 5" in res.stdout

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(mutate(a2_table(), lambda t: _dev(t, d=1).update(device_ip="192.168.1"))))
    res = run_cli("validate", str(bad))
    assert res.returncode == 1
    assert "server_group_list[1].server_list[0].device[1].device_ip: not an IPv4 address" in res.stderr

    notjson = tmp_path / "broken.json"
    notjson.write_text("{")
    res = run_cli("validate", str(notjson))
    assert res.returncode == 1 and "not valid JSON" in res.stderr

    res = run_cli("validate", str(tmp_path / "missing.json"))
    assert res.returncode == 1 and "cannot read" in res.stderr

    assert run_cli("frobnicate").returncode == 2


def test_cli_generate_then_validate(tmp_path: Path) -> None:
    out = tmp_path / "rt.json"
    res = run_cli(
        "generate",
        "--prefill",
        "10.0.0.1:192.168.1.1,192.168.1.2",
        "--decode",
        "10.0.0.2:192.168.2.1",
        "--router",
        "10.0.0.9",
        "-o",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert load_rank_table(out) == generate(
        [parse_host_spec("10.0.0.1:192.168.1.1,192.168.1.2")],
        [parse_host_spec("10.0.0.2:192.168.2.1")],
        router="10.0.0.9",
    )
    assert run_cli("validate", str(out)).returncode == 0


def test_cli_generate_reports_faults(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--prefill", "10.0.0.1:192.168.1.1", "--decode", "10.0.0.2:192.168.1.1"])
    assert rc == 1
    assert "device_ip: 192.168.1.1 is also used by" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prefill", "10.0.0.1", "--decode", "10.0.0.2:192.168.1.1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["generate", "--prefill", "10.0.0.1:1.1.1.1", "--decode", "10.0.0.2:1.1.1.2", "--super-pod", "0=10.0.0.1"])


def test_cli_generate_stdout_is_valid_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prefill", "10.0.0.1:1.1.1.1/5", "--decode", "10.0.0.2:1.1.1.2/6", "--a3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == "1.2" and parse_rank_table(data).is_a3

"""hicache bench transfer: the modes and what each row is held against."""

from __future__ import annotations

import json

import pytest

from hicache.cli.benchmarks import transfer


def run_json(argv: list[str], capsys) -> dict:
    assert transfer.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_every_mode_is_held_against_its_own_contiguous_limit(capsys):
    result = run_json(["--device", "cpu", "--page-kib", "16", "64", "--total-mib", "2",
                       "--repeats", "2"], capsys)
    assert [(r["op"], r["page_kib"]) for r in result["rows"]] == [
        (op, kib) for kib in (16, 64) for op in ("load", "backup", "both")]
    assert result["reference"] == {"load": "copy", "backup": "copy", "both": "copy_both"}
    assert set(result["limits"]) == {"copy", "copy_both"}
    for row in result["rows"]:
        limit = result["limits"][result["reference"][row["op"]]]
        assert row["gbps"] > 0 and row["x_limit"] == round(row["gbps"] / limit, 2)
        # 4 layers, K and V: a page is 8 rows of page_kib
        assert row["page_nbytes"] == 8 * row["page_kib"] * 1024


def test_modes_measure_only_what_is_asked(capsys):
    result = run_json(["--device", "cpu", "--page-kib", "16", "--total-mib", "1",
                       "--repeats", "1", "--modes", "both"], capsys)
    assert [r["op"] for r in result["rows"]] == ["both"]


def test_an_unknown_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        transfer.main(["--modes", "sideways"])
    assert exc.value.code == 2
    assert "--modes" in capsys.readouterr().err

"""``hicache bench storage``: both modes measured in one run, one JSON line last."""

from __future__ import annotations

import json

import pytest

from hicache import cli


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(["bench", "storage", *argv])
    except SystemExit as exc:  # argparse's own exit
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_storage_measures_both_modes_and_ends_with_json(tmp_path, capsys):
    rc, out, _ = run(["--page-kib", "16", "--total-mib", "1", "--repeats", "1",
                      "--dir", str(tmp_path)], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].split() == ["backend", "op", "page_kib", "no", "secret", "secret", "ratio"]
    result = json.loads(lines[-1])
    modes = sorted((r["backend"], r["op"], r["secret"]) for r in result["rows"])
    assert modes == [("file", op, s) for op in ("read", "write") for s in (False, True)]
    assert all(r["gbps"] > 0 for r in result["rows"])
    assert result["auth_gbps_per_core"] > 0 and result["crc32_gbps_per_core"] > 0
    assert list(tmp_path.iterdir()) == []  # its store is removed afterwards
    rc, out, _ = run(["--page-kib", "16", "--total-mib", "1", "--repeats", "1", "--json",
                      "--dir", str(tmp_path)], capsys)
    assert rc == 0 and len(out.splitlines()) == 1 and json.loads(out)["rows"]


@pytest.mark.parametrize("argv, expected", [
    (["--page-kib", "0"], "--page-kib: expected an integer > 0"),
    (["--page-kib", "2048", "--total-mib", "1"], "--total-mib: expected at least one page"),
    (["--dir", "/no/such/dir"], "--dir: expected an existing directory"),
])
def test_bench_storage_user_errors(argv, expected, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and expected in err, (rc, out, err)

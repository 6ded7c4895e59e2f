"""``hicache storage info|clear|bump-epoch SPEC`` on a file tier: what it prints, what it
changes in the tier, and bad input as one line on stderr with exit status 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_runs import run_cli
from optional import available

from hicache.storage import FileStorage, page_keys
from hicache.storage.base import VALUE_HEADER_NBYTES

PAGE = 64


def _tier(tmp_path, num_pages: int = 3) -> tuple[str, list[str]]:
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    keys = page_keys(np.arange(2 * num_pages), 2, None, "fp", "m", epoch=store.epoch())
    assert store.set(keys, [bytes([i]) * PAGE for i in range(num_pages)]) == num_pages
    return f"file:{tmp_path}", keys


def test_info_clear_and_bump_epoch_on_a_file_tier(tmp_path, capsys):
    spec, keys = _tier(tmp_path)
    value_nbytes = VALUE_HEADER_NBYTES + PAGE
    rc, out, err = run_cli(["storage", "info", spec, "--json"], capsys)
    assert rc == 0 and err == ""
    assert json.loads(out) == {"spec": spec, "epoch": 0, "pages": 3, "bytes": 3 * value_nbytes}
    rc, out, _ = run_cli(["storage", "info", spec], capsys)
    assert out.split("\n")[1:4] == ["  epoch  0", "  pages  3", f"  bytes  {3 * value_nbytes}"]
    rc, out, _ = run_cli(["storage", "bump-epoch", spec], capsys)
    assert rc == 0 and out == f"{spec}: epoch 0 -> 1; caches opened from now on read no page " \
                              "stored before\n"
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    assert store.epoch() == 1 and store.exists(keys) == 3  # bumped, not removed
    rc, out, _ = run_cli(["storage", "clear", spec, "--yes", "--json"], capsys)
    assert rc == 0 and json.loads(out) == {"spec": spec, "pages_removed": 3, "epoch": 1}
    assert store.exists(keys) == 0 and store.epoch() == 1


@pytest.mark.parametrize("argv, expected", [
    (["storage", "clear", "SPEC"], "pass --yes to confirm"),
    (["storage", "info", "file:MISSING"], "no such directory (a tier is never created here)"),
    (["storage", "bump-epoch", "file:MISSING"], "no such directory"),
    (["storage", "info", "s3://bucket"], "storage spec: expected 'file:DIR' or 'mooncake://"),
    (["storage", "info", "file:"], "(no DIR)"),
    (["storage", "info"], "the following arguments are required: spec"),
    (["storage", "wipe", "SPEC"], "invalid choice: 'wipe'"),
    # Mooncake installed: its master is not there; not installed: what to install.
    (["storage", "info", "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata"],
     "mooncake: master at 127.0.0.1:1 is unreachable" if available("mooncake")
     else "the Mooncake backend needs the 'mooncake' extra"),
    (["storage", "info", "SPEC"], "expected a decimal epoch"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, expected):
    spec, _ = _tier(tmp_path)
    (tmp_path / "EPOCH").write_text("damaged\n")
    argv = [a.replace("SPEC", spec).replace("MISSING", str(tmp_path / "missing")) for a in argv]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert not (tmp_path / "missing").exists()
    assert FileStorage(tmp_path, page_nbytes=PAGE).usage().num_pages == 3  # nothing removed

"""The Mooncake tier's epoch record against a real ``mooncake_master`` on loopback.

Skipped when the optional extra is not installed, unless HICACHE_REQUIRE_MOONCAKE=1
(CI), in which case a missing package fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from optional import need

from hicache.storage import StorageError, make_storage, page_keys

need("mooncake")

from hicache.storage.mooncake import EPOCH_KEY  # noqa: E402
from hicache.testing.mooncake_master import start_mooncake_master  # noqa: E402

PAGE_NBYTES = 1024
FP, MID = "L2-H2-D8-float16-P4", "test-model"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    handle = start_mooncake_master(segment_nbytes=16 << 20,
                                   log_dir=tmp_path_factory.mktemp("mooncake"))
    yield handle
    handle.stop()


def test_mooncake_epoch_is_shared_kept_by_clear_and_retires_old_keys(master):
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as a, \
            make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as b:
        e0 = a.epoch()  # 0 on a new master; the tests of this module share one
        assert b.epoch() == e0
        old = page_keys(np.arange(8), 4, None, FP, MID, epoch=e0)
        assert a.set(old, [bytes([i]) * PAGE_NBYTES for i in range(2)]) == 2
        assert b.bump_epoch() == e0 + 1 and a.epoch() == e0 + 1  # one tier, one epoch
        new = page_keys(np.arange(8), 4, None, FP, MID, epoch=a.epoch())
        assert a.exists(new) == 0 and a.exists(old) == 2  # old pages stay, under old keys
        assert a.usage() is None  # the store cannot count without listing
        assert a.clear() == 2  # the pages; the epoch record is put back
        assert a.epoch() == b.epoch() == e0 + 1 and a.exists(old) == 0


def test_mooncake_damaged_epoch_record_is_a_storage_error(master):
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as store:
        assert store._client.upsert(EPOCH_KEY, b"x1\n") == 0
        with pytest.raises(StorageError, match="expected a decimal epoch"):
            store.epoch()
        assert store._client.upsert(EPOCH_KEY, b"7\n") == 0
        assert store.bump_epoch() == 8
        store.clear()


def test_the_storage_command_on_a_mooncake_tier(master, capsys):
    import json

    from hicache.cli import app as cli

    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as store:
        before = store.epoch()
    assert cli.main(["storage", "bump-epoch", master.spec, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"spec": master.spec, "epoch": before + 1}
    assert cli.main(["storage", "info", master.spec, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "spec": master.spec, "epoch": before + 1, "pages": None, "bytes": None}

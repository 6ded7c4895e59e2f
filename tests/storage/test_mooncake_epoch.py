"""The Mooncake tier's epoch record against a real ``mooncake_master`` on loopback.

Skipped when the optional extra is not installed, unless HICACHE_REQUIRE_MOONCAKE=1
(CI), in which case a missing package fails.
"""

from __future__ import annotations

import time

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


def _pages(store, epoch: int, fill: int) -> list[str]:
    keys = page_keys(np.arange(8), 4, None, FP, MID, epoch=epoch)
    assert store.set(keys, [bytes([fill]) * PAGE_NBYTES] * 2) == 2
    return keys


def test_the_epoch_outlives_the_client_whose_segment_held_it(master):
    """The reported failure: the segment holder keeps pages stored before a bump; the
    client that bumped lent the memory the epoch object may have been placed in, and
    exits. A client opened afterwards must still read the bumped epoch (the master's
    own record holds it) and miss the old pages."""
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as b:
        e0 = b.epoch()
        old = _pages(b, e0, 1)  # in the holder's segment (b lends none)
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=64 << 20) as a:
        bumped = a.bump_epoch()
        assert bumped == e0 + 1
        a._client.remove(EPOCH_KEY, True)  # as if the object had lived in a's segment
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as c:
        assert c.epoch() == bumped
        assert c.exists(old) == 2  # still stored, under keys nobody at epoch 1 asks for
        new = page_keys(np.arange(8), 4, None, FP, MID, epoch=c.epoch())
        assert c.exists(new) == 0


def test_advancing_to_one_epoch_makes_instances_agree(master):
    """Two instances that each retire their pages after the same weight update advance
    to their epoch + 1 and agree (two bumps would leave them one apart, sharing
    nothing); a record already past the epoch asked for stays."""
    with make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as a, \
            make_storage(master.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as b:
        mine = a.epoch()
        assert b.epoch() == mine
        assert a.advance_epoch(mine + 1) == mine + 1
        assert b.advance_epoch(mine + 1) == mine + 1
        assert a.epoch() == b.epoch() == mine + 1
        assert b.advance_epoch(mine) == mine + 1  # never back


def test_the_epoch_comes_back_after_a_master_restart(tmp_path):
    """A master restart empties the store and its metadata: the live client that knows
    the epoch puts it back, so a client opened afterwards (even while it is missing:
    it waits epoch_wait_s for that) reads it, not 0; pages written after the restart
    are served again without reopening anything."""
    with start_mooncake_master(segment_nbytes=16 << 20, log_dir=tmp_path / "mc") as m, \
            make_storage(m.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0,
                         retry_after_s=0.1) as a:
        epoch = a.bump_epoch()
        keys = _pages(a, epoch, 3)
        m.kill_master()
        with pytest.raises(StorageError):
            a.exists(keys)
        m.restart_master()
        with make_storage(m.spec, page_nbytes=PAGE_NBYTES, segment_nbytes=0) as c:
            assert c.epoch() == epoch
        deadline = time.monotonic() + 30
        while True:  # the holder remounts its segment, the client reconnects
            try:
                if a.exists(keys) == 0 and a.set(keys, [b"\x04" * PAGE_NBYTES] * 2) == 2:
                    break
            except StorageError:
                pass
            assert time.monotonic() < deadline, "writes did not resume after the restart"
            time.sleep(0.2)
        assert a.get(keys) == [b"\x04" * PAGE_NBYTES] * 2

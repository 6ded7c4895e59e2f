"""The storage epoch: kept in the tier, salted into every page key, bumped to retire every
page stored before (an in-place weight update; issue 25.8). File backend and HiCache;
the Mooncake record is tested in test_mooncake_epoch.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from kv_layouts import KV_TINY
from leak_checks import assert_no_leaks
from serving import serve

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.storage import FileStorage, StorageError, page_keys, root_key
from hicache.storage.base import VALUE_HEADER_NBYTES, StorageUsage

FP, MID, PAGE = "L1-H1-D2-float32-P2", "m@r1", 16
A = [1] * 6  # 3 pages of KV_TINY


# ------------------------------------------------------------------ keys
def test_epoch_zero_keeps_the_keys_of_stores_written_before_epochs():
    # pinned (the key before epochs existed): such a store still serves under epoch 0
    assert root_key(None, FP, MID) == "740d98a5e37c9bbdd84b9f690155f6d1"
    assert root_key(None, FP, MID, epoch=0) == root_key(None, FP, MID)
    keys = {root_key(None, FP, MID, epoch=e) for e in range(4)}
    assert len(keys) == 4
    t = np.arange(8)
    assert page_keys(t, 2, None, FP, MID, epoch=1)[0] != page_keys(t, 2, None, FP, MID)[0]
    assert page_keys(t, 2, None, FP, MID, epoch=1)[:2] == page_keys(t[:4], 2, None, FP, MID,
                                                                    epoch=1)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError),
                                        ("1", TypeError)])
def test_a_bad_epoch_is_refused_by_name(bad, error):
    with pytest.raises(error, match="^epoch: expected"):
        root_key(None, FP, MID, epoch=bad)


# ------------------------------------------------------------- file record
def test_file_epoch_is_kept_in_the_tier_and_survives_clear(tmp_path):
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    assert store.epoch() == 0 and not (tmp_path / "EPOCH").exists()
    assert store.bump_epoch() == 1 and store.bump_epoch() == 2
    assert (tmp_path / "EPOCH").read_text() == "2\n"
    other = FileStorage(tmp_path, page_nbytes=PAGE)  # another instance (process) sees it
    assert other.epoch() == 2
    keys = page_keys(np.arange(6), 2, None, FP, MID, epoch=2)
    assert store.set(keys, [bytes([i]) * PAGE for i in range(3)]) == 3
    assert store.usage() == StorageUsage(3, 3 * (VALUE_HEADER_NBYTES + PAGE))
    assert store.clear() == 3  # the pages, not the epoch record
    assert store.epoch() == other.epoch() == 2 and store.usage() == StorageUsage(0, 0)


def test_a_damaged_epoch_record_is_a_storage_error(tmp_path):
    (tmp_path / "EPOCH").write_text("two\n")
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    with pytest.raises(StorageError, match="EPOCH holds 'two\\\\n', expected a decimal epoch"):
        store.epoch()
    with pytest.raises(StorageError, match="expected a decimal epoch"):
        store.bump_epoch()
    assert store.counters().num_errors == 2


def _advance(root: str, epoch: int) -> int:
    return FileStorage(root, page_nbytes=PAGE).advance_epoch(epoch)


def test_advancing_to_one_epoch_from_processes_agrees_and_never_goes_back(tmp_path):
    """Instances that retire their pages after the same weight update each advance to
    their epoch + 1 and agree on it (bumps would hand out one epoch each)."""
    with ProcessPoolExecutor(4) as pool:
        assert list(pool.map(_advance, [str(tmp_path)] * 8, [3] * 8)) == [3] * 8
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    assert store.epoch() == 3 and (tmp_path / "EPOCH").read_text() == "3\n"
    assert store.advance_epoch(1) == 3 and store.epoch() == 3  # a record past it stays
    assert store.bump_epoch() == 4
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="epoch"):
            store.advance_epoch(bad)


def _bump_many(root: str, times: int) -> list[int]:
    store = FileStorage(root, page_nbytes=PAGE)
    return [store.bump_epoch() for _ in range(times)]


def test_concurrent_bumps_from_processes_each_get_their_own_epoch(tmp_path):
    with ProcessPoolExecutor(4) as pool:
        results = list(pool.map(_bump_many, [str(tmp_path)] * 4, [10] * 4))
    epochs = sorted(e for r in results for e in r)
    assert epochs == list(range(1, 41))  # no epoch handed out twice, none skipped
    assert FileStorage(tmp_path, page_nbytes=PAGE).epoch() == 40


def test_other_backends_keep_an_epoch_per_instance():
    from hicache.storage.base import StorageBackend

    class Memory(StorageBackend):
        _exists = _get_into = _set = _delete = _clear = _close = None

    m = Memory(PAGE)
    assert (m.epoch(), m.bump_epoch(), m.epoch(), m.usage()) == (0, 1, 1, None)
    assert (m.advance_epoch(3), m.advance_epoch(2), m.epoch()) == (3, 3, 3)


# ------------------------------------------------------------------ HiCache
def _config(tmp_path, **kw) -> CacheConfig:
    return CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, storage=f"file:{tmp_path}",
                       model_id=MID, executor="thread", tree="python", **kw)


def _write(cache: HiCache, tokens) -> None:
    """Serve ``tokens`` and wait until their pages are in storage."""
    serve(cache, tokens)
    cache.wait_all()


SECOND_PROCESS = textwrap.dedent("""
    import sys
    from hicache.cache import HiCache
    from hicache.config import CacheConfig, KVConfig
    kv = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=2)
    cfg = CacheConfig(kv, device_tokens=16, host_tokens=32, storage="file:" + sys.argv[1],
                      model_id="m@r1", executor="thread", tree="python")
    with HiCache(cfg) as cache:
        job = cache.prefetch([1] * 6)
        if job is not None:
            job.done.wait()
        cache.poll()
        print(cache._third_tier.epoch, cache.tree.host_tokens)
""")


def _second_process(tmp_path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tmp_path)], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return int(out[0]), int(out[1])


def test_old_epoch_pages_miss_after_a_bump_in_this_and_other_processes(tmp_path):
    with HiCache(_config(tmp_path)) as old:
        _write(old, A)  # 3 pages under epoch 0: the old weights' KV
        store = old.storage.backend
        assert store.usage().num_pages == 3
    with HiCache(_config(tmp_path)) as cache:
        r = cache.reset(new_epoch=True)  # the weights changed in place
        assert r.storage_epoch == 1 and r.storage_pages_deleted is None and r.complete
        assert cache.prefetch(A) is None  # the old pages are not this epoch's
        h = cache.match(A)
        assert h.prefix_len == 0 and cache.stats()["storage_hit_tokens"] == 0
        cache.release(h)
        assert_no_leaks(cache)
    assert _second_process(tmp_path) == (1, 0)  # a process opening the tier now misses too
    with HiCache(_config(tmp_path)) as fresh:
        assert fresh._third_tier.epoch == 1 and fresh.prefetch(A) is None
        _write(fresh, A)  # the new weights' KV, under epoch 1
        assert FileStorage(tmp_path, page_nbytes=1).usage().num_pages == 6  # old pages stay
        assert_no_leaks(fresh)
    assert _second_process(tmp_path) == (1, 6)  # the new pages are shared (so it can hit)


def test_new_epoch_without_a_third_tier_does_nothing_and_bad_input_is_refused(tmp_path):
    cache = HiCache(CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, allocate_kv=False))
    serve(cache, A)
    assert cache.reset(new_epoch=True).storage_epoch is None
    with pytest.raises(TypeError, match="new_epoch: expected bool, got int"):
        cache.reset(new_epoch=1)
    assert_no_leaks(cache)


def test_a_new_epoch_is_a_storage_cleared_event(tmp_path):
    from hicache.events import AllBlocksCleared

    with HiCache(_config(tmp_path, kv_events=True)) as cache:
        _write(cache, A)
        cache.take_events()
        cache.reset(new_epoch=True)
        assert AllBlocksCleared("storage") in cache.take_events()
        assert_no_leaks(cache)

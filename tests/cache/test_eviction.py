"""What eviction takes, and when: a refused allocation or load evicts nothing, no
unlocked node is out of eviction's reach, write-back frees a whole chain in one
allocation (even while backups fail), and a backup that cannot fit keeps complete host
copies.

Each test failed before its fix. Scenarios with KV run on the manual executor;
bookkeeping scenarios run on both trees and, over the native tree, on both lifecycles.
"""

from __future__ import annotations

import pytest
from kv_layouts import LIFECYCLES, P, kv_one_float, seq
from leak_checks import assert_no_leaks
from manual_executor import (
    KV_F16,
    complete,
    host_only,
    make_cache,
    serve_manual,
)
from serving import bookkeeping, serve

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.sim import kvcheck


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_refused_alloc_evicts_nothing(tree, lifecycle):
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(16), device_tokens=160, host_tokens=None)
    serve(c, [1] * 48)  # 3 cached pages
    r = c.match([2] * 97)
    c.alloc(r, 97)
    c.insert(r, [2] * 97)  # 7 pages held
    before = c.stats()
    g = c.match([4] * 64)
    assert c.alloc(g, 64) is None  # needs 4, only 3 evictable
    assert c.tree.match_prefix([1] * 48).device_len == 48, "a refused alloc evicted"
    after = c.stats()
    for key in ("device_evicted_tokens", "device_pages_used", "device_cached_tokens"):
        assert after[key] == before[key], key
    assert c.alloc(g, 48) is not None  # exactly what can be freed: succeeds
    assert c.tree.match_prefix([1] * 48).device_len == 0
    c.release(g)
    c.release(r)
    assert_no_leaks(c)


def test_refused_load_evicts_nothing():
    cache = make_cache(device_pages=6)
    a, b = seq(100, 4), seq(300, 2)
    host_only(cache, a)
    serve_manual(cache, b)
    complete(cache)
    hog = cache.match(seq(500, 3))
    assert cache.alloc(hog, 3 * P) is not None  # 1 free + B's 2 unlocked: 3 < 4
    h = cache.match(a)
    assert h.prefix_len == 0 and cache.stats()["loads_refused_no_space"] == 1
    assert cache.tree.match_prefix(b).device_len == len(b), "a refused load evicted"
    cache.release(h)
    cache.release(hog)
    complete(cache)
    assert_no_leaks(cache)


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_no_unlocked_node_that_eviction_cannot_take(tree, lifecycle):
    # page 2, device 16 tokens, host 4 tokens: the parent [1]*6 does not fit the host
    # tier; its child used to be backed up anyway, then pushed off the device.
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(2), device_tokens=16, host_tokens=4)
    serve(c, [1] * 6)
    serve(c, [1] * 6 + [2] * 2)
    c.wait_all()
    c.check_integrity()  # a host copy implies host copies of every ancestor
    s = c.stats()
    free = s["device_pages_free"]
    assert free + c.tree.device_evictable_tokens // 2 >= 6
    h = c.match([7] * 12)
    assert c.alloc(h, 12) is not None, "alloc refused although the pages can be freed"
    c.release(h)
    assert_no_leaks(c)


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_write_back_frees_a_whole_chain_in_one_alloc(tree, lifecycle):
    # A chain of three nodes, nothing on the host: write-back frees leaf by leaf (a
    # parent is a leaf once its child's backup landed); one alloc takes all of them.
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(2), device_tokens=12, host_tokens=24,
                    write_policy="write_back")
    serve(c, [1] * 4)
    serve(c, [1] * 8)
    serve(c, [1] * 12)
    h = c.match([9] * 12)
    assert c.alloc(h, 12) is not None
    assert c.stats()["device_evicted_tokens"] == 12
    c.release(h)
    assert c.tree.match_prefix([1] * 12).host_len == 12
    assert_no_leaks(c)


def test_storage_read_not_inserted_below_a_node_without_host_copy(tmp_path):
    # A third-tier read extends a prefix; below a device-only node its host pages
    # would break the invariant (and leave that node unevictable): they are dropped.
    cfg = dict(device_tokens=16, host_tokens=32, storage=f"file:{tmp_path}", model_id="m",
               executor="immediate", host_reserve_nbytes=0)
    first = HiCache(CacheConfig(KV_F16, **cfg))
    serve(first, seq(100, 4))
    first.close()
    cache = HiCache(CacheConfig(KV_F16, write_policy="write_back", **cfg))
    serve(cache, seq(100, 2))  # device-only (write-back)
    h = cache.match(seq(100, 4))
    cache.wait_all()
    cache.check_integrity()
    cache.release(h)
    cache.wait_all()
    assert_no_leaks(cache)
    cache.close()


def test_backup_that_cannot_fit_evicts_nothing_on_the_host():
    cache = make_cache(device_pages=12, host_pages=4)
    a, b = seq(100, 2), seq(300, 3)
    serve_manual(cache, a)
    complete(cache)  # A on both tiers: 2 host pages
    serve_manual(cache, seq(500, 2))  # its backup stays in flight: 2 more host pages
    s = cache.stats()
    assert s["host_pages_free"] == 0
    serve_manual(cache, b)  # 3 pages: A's 2 plus nothing else can be evicted
    assert cache.tree.match_prefix(a).last_node.on_host, "a backup that could not fit evicted"
    assert cache.stats()["backups_skipped"] == 1
    complete(cache)
    assert_no_leaks(cache)


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_backup_that_cannot_fit_keeps_complete_host_copies(tree, lifecycle):
    # page 2, host 4 pages. P=[1]*4 (2 pages) and L=[5]*2 (1 page) on both tiers; then
    # P's child C (3 pages) needs 2 pages more than are free. Only L can make room:
    # P's host copy must stay for C's. It used to be counted as room all the same,
    # so L was evicted and C's backup skipped anyway.
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(2), device_tokens=32, host_tokens=8)
    serve(c, [1] * 4)
    serve(c, [5] * 2)
    before = c.stats()
    assert before["host_pages_used"] == 3
    serve(c, [1] * 4 + [2] * 6)
    after = c.stats()
    assert after["backups_skipped"] == before["backups_skipped"] + 1
    assert after["host_evicted_tokens"] == before["host_evicted_tokens"] == 0, "evicted anyway"
    assert after["host_pages_used"] == 3 and after["host_cached_tokens"] == 6
    assert c.tree.match_prefix([5] * 2).last_node.on_host
    # P's host copy is takeable now (its only child has none), L's too.
    assert c.tree.host_takeable_tokens == 6
    # A backup that fits by taking P's host copy (the match above made L more recent).
    serve(c, [7] * 6)
    s = c.stats()
    assert s["host_evicted_tokens"] == 4 and s["host_pages_used"] == 4
    assert s["backups_skipped"] == after["backups_skipped"]
    assert not c.tree.match_prefix([1] * 4).last_node.on_host
    assert c.tree.match_prefix([5] * 2).last_node.on_host
    assert_no_leaks(c)


class FailFirstBackups:
    """A page copier whose first ``n`` backup calls fail (one layer of a transfer each)."""

    def __init__(self, inner, n: int) -> None:
        self.inner = inner
        self.left = n

    def load(self, host_ids, device_ids, first, last):
        self.inner.load(host_ids, device_ids, first, last)

    def backup(self, device_ids, host_ids, first, last):
        if self.left:
            self.left -= 1
            raise RuntimeError("injected backup fault")
        self.inner.backup(device_ids, host_ids, first, last)


def test_write_back_alloc_succeeds_after_one_failed_backup():
    from hicache.sim.faults import _executor

    cfg = CacheConfig(KV_F16, device_tokens=10 * P, host_tokens=20 * P, executor="thread",
                      host_reserve_nbytes=0, write_policy="write_back")
    with HiCache(cfg) as cache:
        a = seq(100, 5)
        h = cache.match(a)
        assert cache.alloc(h, len(a)) is not None
        kvcheck.write_kv(cache.device_pool, h.page_table(), a, 0, len(a))
        cache.insert(h, a)
        cache.release(h)
        ex = _executor(cache)
        ex._copier = FailFirstBackups(ex._copier, 1)
        h = cache.match(seq(900, 6))  # 5 free: one page of A must go through a backup
        assert cache.alloc(h, 6 * P) is not None, "alloc refused after one failed backup"
        s = cache.stats()
        assert s["backups_failed"] == 1 and s["device_evicted_tokens"] == P
        cache.release(h)
        cache.wait_all()
        assert kvcheck.verify_cache(cache) == []
        m = cache.tree.match_prefix(a)
        assert (m.device_len, m.host_len) == (len(a) - P, P)
        assert_no_leaks(cache)


def test_write_back_alloc_drops_unbacked_pages_while_every_backup_fails():
    """Three rounds of failed eviction backups, then the unbacked tail is dropped: the
    allocation succeeds (it was refused, and so was every later request: issue 25.7)."""
    from hicache.sim.faults import _executor

    cfg = CacheConfig(KV_F16, device_tokens=10 * P, host_tokens=20 * P, executor="thread",
                      host_reserve_nbytes=0, write_policy="write_back")
    with HiCache(cfg) as cache:
        a = seq(100, 5)
        h = cache.match(a)
        assert cache.alloc(h, len(a)) is not None
        cache.insert(h, a)
        cache.release(h)
        ex = _executor(cache)
        ex._copier = FailFirstBackups(ex._copier, 10**9)
        h = cache.match(seq(900, 6))
        assert cache.alloc(h, 6 * P) is not None  # a bounded number of tries, then a drop
        s = cache.stats()
        assert s["backups_failed"] == 3 and s["host_cached_tokens"] == 0
        assert s["unbacked_dropped_tokens"] == s["device_evicted_tokens"] == P  # A's last page
        assert cache.tree.match_prefix(a).device_len == len(a) - P
        cache.release(h)
        cache.wait_all()
        assert_no_leaks(cache)

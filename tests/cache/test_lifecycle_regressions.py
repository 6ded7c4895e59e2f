"""Regressions for the request lifecycle's KV-correctness and liveness bugs (issues 13, 16).

Each test failed before its fix. Scenarios with KV run on the manual executor and
verify KV byte for byte; bookkeeping scenarios run on both trees and, over the
native tree, on both lifecycles.
"""

from __future__ import annotations

import pytest
from kv_layouts import TREE_KINDS, P, seq
from leak_checks import assert_no_leaks
from manual_executor import (
    KV_F16,
    complete,
    host_only,
    make_cache,
    pending,
    serve_manual,
    verify_prefix,
)
from serving import bookkeeping, serve

from hicache.cache import HiCache, LoadError
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck
from hicache.transfer import TransferKind

# (tree, lifecycle) pairs: the Python reference, the native tree under the Python
# lifecycle, and the C++ lifecycle.
LIFECYCLES = [("python", "python")] + (
    [("native", "python"), ("native", "native")] if "native" in TREE_KINDS else []
)


def kv(page_size: int) -> KVConfig:
    return KVConfig(1, 1, 1, "float32", page_size=page_size)


# ------------------------------------------------------- issue 16 item 1
def test_load_back_after_alloc_is_refused_and_changes_nothing():
    cache = make_cache()
    stem, a = seq(100, 2), seq(300, 2)
    serve_manual(cache, stem)
    host_only(cache, stem + a)
    serve_manual(cache, stem)  # the stem on the device, A host-only below it
    tokens = stem + a + [7, 7]
    h = cache.match(tokens, load_back=False)
    assert (h.prefix_len, h.host_len) == (len(stem), len(a))
    assert cache.alloc(h, len(tokens) - h.prefix_len) is not None
    kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, len(tokens))
    table = h.page_table().clone()
    with pytest.raises(ValueError, match="owns 3 pages"):
        cache.load_back(h)
    assert h.prefix_len == len(stem) and pending(cache, TransferKind.LOAD) == []
    assert h.page_table().equal(table)
    cache.check_integrity()
    cache.insert(h, tokens)  # what the caller computed is what gets cached
    cache.release(h)
    complete(cache)
    h = cache.match(tokens)
    assert h.prefix_len == len(tokens)
    verify_prefix(cache, h, tokens)
    cache.release(h)
    complete(cache)
    assert_no_leaks(cache)


def test_load_back_retried_before_alloc_still_loads():
    cache = make_cache(device_pages=6)
    a = seq(100, 3)
    host_only(cache, a)
    hog = cache.match(seq(200, 6))
    assert cache.alloc(hog, 6 * P) is not None
    h = cache.match(a + [1])
    assert h.prefix_len == 0  # refused: no room
    cache.release(hog)
    assert cache.load_back(h) is not None
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    complete(cache)
    assert_no_leaks(cache)


# ------------------------------------------------------- issue 16 items 3, 11
def test_a_failed_load_is_applied_only_by_its_own_request():
    """Two live requests in one step: B's alloc must not hand A's pages to B."""
    cache = make_cache(device_pages=12)
    a = seq(100, 3)
    host_only(cache, a)
    ta, tb = a + seq(500, 2), seq(700, 2)
    ha = cache.match(ta)
    hb = cache.match(tb)
    assert ha.prefix_len == len(a)
    pages_a = cache.alloc(ha, len(ta) - ha.prefix_len)
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    table_a = ha.page_table().clone()
    pages_b = cache.alloc(hb, len(tb))  # polls: A's failure lands inside B's call
    assert pages_b is not None
    assert not set(pages_b.tolist()) & set(table_a.tolist()), "B received A's pages"
    assert ha.prefix_len == len(a) and ha.page_table().equal(table_a)
    assert ha.num_owned_pages == pages_a.shape[0]
    with pytest.raises(LoadError):
        ha.wait_layer(0)  # reported to A until A's own call applies it
    with pytest.raises(LoadError):
        ha.wait_layer(0)
    cache.check_integrity()
    # B computes and inserts in the same step; its KV is intact.
    kvcheck.write_kv(cache.device_pool, hb.page_table(), tb, 0, len(tb))
    cache.insert(hb, tb)
    assert not cache.finish_loads(ha)
    assert ha.prefix_len == 0 and ha.num_owned_pages == 0
    assert isinstance(ha.load_error, RuntimeError)
    ha.wait_layer(0)  # reported: no longer raises
    # A recomputes from prefix_len 0 (A's prefix is being loaded again in place).
    assert cache.alloc(ha, len(ta)) is not None
    kvcheck.write_kv(cache.device_pool, ha.page_table(), ta, 0, len(ta))
    complete(cache, TransferKind.LOAD)
    cache.insert(ha, ta)
    assert cache.finish_loads(ha) and ha.load_error is None  # cleared once nothing failed
    verify_prefix(cache, ha, ta)
    verify_prefix(cache, hb, tb)
    cache.release(ha)
    cache.release(hb)
    complete(cache)
    assert kvcheck.verify_cache(cache) == []
    assert_no_leaks(cache)


def test_insert_after_an_unreported_failure_raises_load_error():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a + [1, 1])
    cache.alloc(h, 2)
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    with pytest.raises(LoadError, match="finish_loads"):
        cache.insert(h, a + [1, 1])
    assert h.prefix_len == 0 and h.num_owned_pages == 0  # applied by h's own call
    assert not cache.finish_loads(h)
    cache.release(h)
    complete(cache)
    assert_no_leaks(cache)


def test_load_error_is_cleared_after_a_successful_retry():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a, load_back=False)
    cache.load_back(h)
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    assert not cache.finish_loads(h) and h.load_error is not None
    complete(cache, TransferKind.LOAD)  # the in-place reload of A lands
    assert cache.load_back(h) is None  # A is on the device again: taken without a load
    assert h.prefix_len == len(a)
    assert cache.finish_loads(h) and h.load_error is None
    verify_prefix(cache, h, a)
    cache.release(h)
    complete(cache)
    assert_no_leaks(cache)


# ------------------------------------------------------- issue 13 item 2
@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_refused_alloc_evicts_nothing(tree, lifecycle):
    c = bookkeeping(tree, lifecycle, kv=kv(16), device_tokens=160, host_tokens=None)
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


# ------------------------------------------------------- issue 13 item 3
@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_no_unlocked_node_that_eviction_cannot_take(tree, lifecycle):
    # page 2, device 16 tokens, host 4 tokens: the parent [1]*6 does not fit the host
    # tier; its child used to be backed up anyway, then pushed off the device.
    c = bookkeeping(tree, lifecycle, kv=kv(2), device_tokens=16, host_tokens=4)
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
    c = bookkeeping(tree, lifecycle, kv=kv(2), device_tokens=12, host_tokens=24,
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


# ------------------------------------------------------- issue 13 item 4
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
    c = bookkeeping(tree, lifecycle, kv=kv(2), device_tokens=32, host_tokens=8)
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


# ------------------------------------------------------- issue 16 item 5
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


# ------------------------------------------------------- issue 16 item 8
def _closed_calls():
    return [
        ("match", lambda c, h: c.match([1, 2])),
        ("alloc", lambda c, h: c.alloc(h, 2)),
        ("insert", lambda c, h: c.insert(h, [1, 2])),
        ("load_back", lambda c, h: c.load_back(h)),
        ("finish_loads", lambda c, h: c.finish_loads(h)),
        ("release", lambda c, h: c.release(h)),
        ("poll", lambda c, h: c.poll()),
        ("wait_all", lambda c, h: c.wait_all()),
        ("prefetch", lambda c, h: c.prefetch([1, 2])),
    ]


@pytest.mark.parametrize(("name", "call"), _closed_calls(), ids=[n for n, _ in _closed_calls()])
@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES[:1] + LIFECYCLES[2:])
def test_every_call_after_close_raises_before_changing_anything(name, call, tree, lifecycle):
    c = bookkeeping(tree, lifecycle, kv=kv(2), device_tokens=16, host_tokens=16)
    serve(c, [1, 2, 3, 4])
    h = c.match([1, 2, 3, 4, 5])
    before = c.stats()
    c.close()
    c.close()  # idempotent
    with pytest.raises(ValueError, match="HiCache is closed"):
        call(c, h)
    c.check_integrity()  # the final state stays readable
    assert c.stats() == before and c.counters == c.counters
    c._closed = False  # only to release the handle and check for leaks
    c.release(h)
    assert_no_leaks(c)


def test_a_transfer_after_close_leaves_no_node_in_flight():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    cache.close()
    with pytest.raises(ValueError, match="HiCache is closed"):
        cache.match(a)  # used to start a load, then fail in the closed engine
    cache.check_integrity()
    assert all(n.lock_ref == 0 and n.host_lock_ref == 0 for n in cache.tree.nodes())


# ------------------------------------------------------- issue 16 item 10
@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
@pytest.mark.parametrize("bad", [
    [1, 2, -1], [1, 2, 2**40], [1, 2, "x"], [1, 2, None], [1, 2, 1.5],
    "np64", "np32", "torch64", "torch32", "np_big",
])
def test_token_ids_in_the_trailing_partial_page_are_validated(tree, lifecycle, bad):
    import numpy as np
    import torch

    made = {
        "np64": np.array([1, 2, -1]), "np32": np.array([1, 2, -1], dtype=np.int32),
        "torch64": torch.tensor([1, 2, -1]), "torch32": torch.tensor([1, 2, -1], dtype=torch.int32),
        "np_big": np.array([1, 2, 2**40]),
    }
    tokens = made.get(bad, bad) if isinstance(bad, str) else bad
    c = bookkeeping(tree, lifecycle, kv=kv(2), device_tokens=16, host_tokens=None)
    before = c.stats()
    with pytest.raises((ValueError, TypeError), match="tokens"):
        c.match(tokens)
    h = c.match([1, 2, 3])
    assert c.alloc(h, 2) is not None
    with pytest.raises((ValueError, TypeError), match="tokens"):
        c.insert(h, tokens)
    assert h.prefix_len == 0 and c.tree.match_prefix([1, 2]).device_len == 0
    c.release(h)
    assert c.stats()["device_cached_tokens"] == before["device_cached_tokens"]
    assert_no_leaks(c)


# ------------------------------------------------------- issue 13 item 1
def index_storage_bytes(tree) -> tuple[int, int]:
    """(bytes of the storages behind the tree's index tensors, each counted once;
    bytes of the page ids the tree caches)."""
    storages: dict[int, int] = {}
    ids = 0
    for node in tree.nodes():
        for idx in (node.device_indices, node.host_indices):
            if idx is not None:
                st = idx.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
                ids += idx.shape[0] * 8
    return sum(storages.values()), ids


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
def test_tree_holds_at_most_twice_the_page_ids_it_caches(tree, lifecycle):
    # A 2,000-page shared prefix, then 1,000 two-page leaves under it (page size 1):
    # each leaf used to keep a view of its request's whole 2,002-page table.
    c = bookkeeping(tree, lifecycle, kv=kv(1), device_tokens=5000, host_tokens=5000)
    stem = list(range(10_000, 12_000))
    serve(c, stem)
    for i in range(1000):
        serve(c, stem + [2 * i, 2 * i + 1])
    held, ids = index_storage_bytes(c.tree)
    assert ids == 8 * 2 * (2000 + 2000)  # both tiers (write-through)
    assert held <= 2 * ids, f"tree holds {held} bytes of index storage for {ids} bytes of ids"
    # Splits: matches ending inside the stem, then evictions that split leaves' parents.
    for cut in (1000, 500, 1500):
        c.release(c.match(stem[:cut] + [7] * 3))
    h = c.match([1] * 4000)
    assert c.alloc(h, 4000) is not None  # pushes most of it off the device
    c.release(h)
    held, ids = index_storage_bytes(c.tree)
    assert held <= 2 * ids, f"after splits: {held} bytes of index storage for {ids} bytes of ids"
    c.check_integrity()
    assert_no_leaks(c)


def test_tree_storage_bounded_with_kv_loads_and_splits():
    cache = make_cache(device_pages=40, host_pages=80)
    stem = seq(100, 16)
    serve_manual(cache, stem)
    for i in range(8):
        serve_manual(cache, stem + seq(1000 + 10 * i, 1))
    complete(cache)
    h = cache.match([])
    assert cache.alloc(h, 40 * P) is not None  # all of it host-only
    cache.release(h)
    serve_manual(cache, stem[: 4 * P] + [3, 3])  # loads back part of the stem: a split load
    complete(cache)
    held, ids = index_storage_bytes(cache.tree)
    assert held <= 2 * ids, f"{held} bytes of index storage for {ids} bytes of ids"
    assert_no_leaks(cache)

"""HiCache: lifecycle with real KV, write policies, eviction across tiers, exhaustion, metrics."""

from __future__ import annotations

import pytest
from kv_layouts import KV, TREE_KINDS
from leak_checks import assert_quiescent, finish_transfers
from serving import compute, read_prefix, serve_kv

from hicache.cache import HiCache
from hicache.config import CacheConfig

TREE = "python"  # set per test by the fixture below: every scenario runs on each tree


@pytest.fixture(autouse=True, params=TREE_KINDS)
def _tree_kind(request):
    global TREE
    TREE = request.param


def make_cache(device_tokens=8, host_tokens=16, executor="thread", **kw) -> HiCache:
    kw.setdefault("tree", TREE)
    if host_tokens is None:
        return HiCache(CacheConfig(KV, device_tokens=device_tokens, executor=executor, **kw))
    cfg = CacheConfig(
        KV, device_tokens=device_tokens, host_tokens=host_tokens, executor=executor, **kw
    )
    return HiCache(cfg)


A = [1, 1, 2, 2, 3, 3]
B = [7, 7, 8, 8, 9, 9]


@pytest.mark.parametrize("executor", ["thread", "manual"])
def test_lifecycle_evict_to_host_and_load_back_bitwise(executor):
    cache = make_cache(device_tokens=8, host_tokens=16, executor=executor)
    serve_kv(cache, A)
    finish_transfers(cache)
    assert cache.tree.host_tokens == 6  # write-through backed A up
    serve_kv(cache, B)  # needs 3 of 4 device pages, 1 free: evicts the tail 2 pages of A
    finish_transfers(cache)
    assert cache.stats()["device_evicted_tokens"] == 4
    h = cache.match(A + [4, 4])
    assert (h.device_len, h.host_len, h.prefix_len) == (2, 4, 6)
    finish_transfers(cache)
    read_prefix(cache, h, A)
    cache.release(h)
    s = cache.stats()
    assert s["host_hit_tokens"] == 4 and s["loads"] == 1
    assert s["load_bytes"] == 2 * KV.page_nbytes
    assert_quiescent(cache)
    cache.close()


def test_device_hit_reuses_pages_without_transfer():
    cache = make_cache()
    serve_kv(cache, A)
    h = cache.match(A)
    assert (h.device_len, h.host_len) == (6, 0)
    read_prefix(cache, h, A)
    cache.release(h)
    assert cache.stats()["loads"] == 0
    assert_quiescent(cache)
    cache.close()


def test_write_through_selective_backs_up_after_threshold_hits():
    cache = make_cache(write_policy="write_through_selective", backup_hit_threshold=2)
    serve_kv(cache, A)
    finish_transfers(cache)
    assert cache.tree.host_tokens == 0
    serve_kv(cache, A)  # hit 1
    finish_transfers(cache)
    assert cache.tree.host_tokens == 0
    serve_kv(cache, A)  # hit 2 reaches the threshold
    finish_transfers(cache)
    assert cache.tree.host_tokens == 6
    assert cache.stats()["backups"] == 1
    assert_quiescent(cache)
    cache.close()


def test_write_back_frees_device_pages_only_after_backup_completes():
    cache = make_cache(device_tokens=8, host_tokens=16, executor="manual", write_policy="write_back")
    serve_kv(cache, A)
    assert cache.tree.host_tokens == 0 and cache.stats()["backups"] == 0
    h = cache.match(B)
    # B needs 3 pages, 1 free: A's tail (2 pages) is backed up at eviction; its pages
    # stay in use until the backup completes
    assert cache.alloc(h, 6) is None
    assert cache.stats()["backups"] == 1
    assert cache.device_allocator.num_free_pages == 1
    (backup,) = cache.transfers.executor.pending()
    assert backup.num_pages == 3  # and A's head, which keeps its device pages (invariant)
    cache.transfers.executor.complete(backup)
    cache.poll()
    assert cache.device_allocator.num_free_pages == 3
    assert cache.stats()["device_evicted_tokens"] == 4
    compute(cache, h, B)
    cache.insert(h, B)
    cache.release(h)
    h = cache.match(A)
    assert (h.device_len, h.host_len) == (2, 4)
    assert cache.tree.match_prefix(A[:2]).last_node.on_host
    finish_transfers(cache)
    read_prefix(cache, h, A)
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_write_back_backup_thread_executor_waits_instead_of_failing():
    cache = make_cache(device_tokens=8, host_tokens=16, write_policy="write_back")
    serve_kv(cache, A)
    serve_kv(cache, B)  # eviction of A's tail waits for its backup on the worker thread
    h = cache.match(A)
    assert (h.device_len, h.host_len) == (2, 4)
    read_prefix(cache, h, A)
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_device_exhaustion_is_a_normal_return():
    cache = make_cache(device_tokens=4, host_tokens=8)
    h1 = cache.match(A)
    assert cache.alloc(h1, 4) is not None
    h2 = cache.match(B)
    assert cache.alloc(h2, 2) is None  # h1 owns everything; nothing to evict
    assert cache.alloc(h2, 0) is not None
    cache.release(h1)
    assert cache.alloc(h2, 2) is not None
    cache.release(h2)
    assert_quiescent(cache)
    cache.close()


def test_host_exhaustion_skips_backup_and_counts_it():
    cache = make_cache(device_tokens=16, host_tokens=4, executor="manual")
    serve_kv(cache, [5, 5, 6, 6])  # backup of 2 pages in flight: the host tier is full
    serve_kv(cache, A)  # needs 3 host pages: more than the tier holds; nothing is evicted
    s = cache.stats()
    assert (s["backups"], s["backups_skipped"], s["host_evicted_tokens"]) == (1, 1, 0)
    finish_transfers(cache)
    assert cache.tree.host_tokens == 4
    assert_quiescent(cache)
    cache.close()


def test_host_full_of_in_flight_backups_skips_not_errors():
    cache = make_cache(device_tokens=16, host_tokens=6, executor="manual")
    serve_kv(cache, A)  # backup of 3 pages pending: host full, nothing evictable
    serve_kv(cache, B)
    s = cache.stats()
    assert s["backups"] == 1 and s["backups_skipped"] == 1
    assert_quiescent(cache)
    cache.close()


def test_host_eviction_drops_device_resident_copy_when_full():
    cache = make_cache(device_tokens=16, host_tokens=6)
    serve_kv(cache, A)
    finish_transfers(cache)
    serve_kv(cache, B)  # host full of A (on device too): A's host copy is dropped for B
    finish_transfers(cache)
    s = cache.stats()
    assert s["host_evicted_tokens"] == 6 and s["backups_skipped"] == 0
    assert cache.match(A).device_len == 6
    for h in list(cache._live):
        cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_load_threshold_refuses_small_host_hits():
    cache = make_cache(device_tokens=8, host_tokens=16, load_threshold_tokens=8)
    serve_kv(cache, A)
    serve_kv(cache, B)
    finish_transfers(cache)
    h = cache.match(A)
    assert (h.host_len, h.prefix_len) == (4, 2)
    cache.release(h)
    s = cache.stats()
    assert s["loads_refused_by_threshold"] == 1 and s["host_hit_refused_tokens"] == 4
    assert s["host_hit_tokens"] == 0 and s["loads"] == 0
    assert_quiescent(cache)
    cache.close()


def test_namespaces_never_share_kv():
    cache = make_cache(device_tokens=16)
    serve_kv(cache, A, namespace="tenant-a")
    h = cache.match(A, namespace="tenant-b")
    assert h.prefix_len == 0
    cache.release(h)
    h = cache.match(A, namespace="tenant-a")
    assert h.prefix_len == 6
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_metrics_exact():
    cache = make_cache(device_tokens=8, host_tokens=16)
    serve_kv(cache, A)  # 6 requested, 0 hit
    finish_transfers(cache)
    serve_kv(cache, A)  # 6 requested, 6 device hit
    serve_kv(cache, B)  # 3 pages needed, 1 free: A's tail (2 pages) leaves the device
    finish_transfers(cache)
    # A + [4, 4]: [1,1] on device, [2,2,3,3] loaded (evicting B's tail, 2 pages),
    # then [4,4] needs 1 page (evicting B's head)
    serve_kv(cache, A + [4, 4])
    finish_transfers(cache)
    s = cache.stats()
    assert s["requests"] == 4
    assert s["requested_tokens"] == 6 + 6 + 6 + 8
    assert s["device_hit_tokens"] == 6 + 2
    assert s["host_hit_tokens"] == 4
    assert s["hit_tokens"] == 12
    assert s["loads"] == 1 and s["load_bytes"] == 2 * KV.page_nbytes
    assert s["inserted_tokens"] == 6 + 6 + 2
    assert s["backups"] == 3  # A, B, then [4, 4]
    assert s["backup_bytes"] == (3 + 3 + 1) * KV.page_nbytes
    assert s["device_evicted_tokens"] == 4 + 4 + 2
    assert s["backups_failed"] == s["loads_failed"] == s["backups_skipped"] == 0
    assert s["device_pages_used"] + s["device_pages_free"] == 4
    assert s["host_pages_used"] == 7
    assert_quiescent(cache)
    cache.close()


def test_insert_frees_pages_cached_meanwhile():
    cache = make_cache(device_tokens=16)
    h1 = cache.match(A)
    h2 = cache.match(A)
    compute(cache, h1, A)
    compute(cache, h2, A)
    assert cache.insert(h1, A) == 6
    assert cache.insert(h2, A) == 0  # h2's 3 pages were duplicates: freed
    assert cache.device_allocator.num_used_pages == 3
    cache.release(h1)
    cache.release(h2)
    assert_quiescent(cache)
    cache.close()


def test_device_only_cache_without_host_tier():
    cache = make_cache(device_tokens=8, host_tokens=None)
    serve_kv(cache, A)
    serve_kv(cache, B)
    h = cache.match(A)
    assert (h.device_len, h.host_len) == (2, 0)  # B took only the 2 pages it lacked
    cache.release(h)
    assert cache.stats()["backups"] == 0
    assert_quiescent(cache)
    cache.close()

"""Eviction-during-IO races, replayed deterministically with the manual executor.

Each test is named after the corruption or leak it guards against. The manual
executor copies a layer only when the test completes it, so if the cache let a
page be freed and reused while a transfer still used it, the late copy would
move the wrong bytes and ``kvcheck`` would report the mismatch. Every scenario
ends at quiescence with ``check_integrity()``, every readable page verified and
zero pages unaccounted for on both tiers.
"""

from __future__ import annotations

import pytest
from kv_layouts import P, seq
from manual_executor import (
    KV_F16,
    complete,
    evict_all_device,
    host_only,
    make_cache,
    pending,
    serve_manual,
    settle,
    verify_prefix,
)

from hicache.cache import LoadError
from hicache.sim import kvcheck
from hicache.transfer import ManualFence, TransferKind

# --------------------------------------------------------------------- scenarios


def test_host_pages_of_a_load_in_flight_are_never_freed_or_reused():
    cache = make_cache(device_pages=8, host_pages=6)
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a)
    (load,) = pending(cache, TransferKind.LOAD)
    a_host = set(load.host_pages.tolist())
    # Fill the host tier with other backups while A's load has not copied a byte.
    serve_manual(cache, seq(200, 3))
    complete(cache, TransferKind.BACKUP)
    serve_manual(cache, seq(300, 2))  # host full: must evict someone other than A
    (backup,) = pending(cache, TransferKind.BACKUP)
    assert a_host.isdisjoint(backup.host_pages.tolist()), "a backup reuses host pages being loaded"
    serve_manual(cache, seq(400, 3))  # nothing evictable left on the host: skipped, not an error
    assert cache.stats()["backups_skipped"] >= 1
    complete(cache, TransferKind.BACKUP)  # the late copies land before A's load reads
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    settle(cache)


def test_device_pages_of_a_backup_in_flight_are_never_evicted_or_reused():
    cache = make_cache(device_pages=6, host_pages=16)
    a = seq(100, 3)
    serve_manual(cache, a)  # write-through backup of A pending
    (backup,) = pending(cache, TransferKind.BACKUP)
    h = cache.match(seq(500, 6))
    assert cache.alloc(h, 6 * P) is None, "evicted pages a backup is still reading"
    mine = cache.alloc(h, 3 * P)
    assert mine is not None and set(mine.tolist()).isdisjoint(backup.device_pages.tolist())
    kvcheck.write_kv(cache.device_pool, h.page_table(), seq(500, 6), 0, 3 * P)
    complete(cache, TransferKind.BACKUP)
    assert kvcheck.verify_cache(cache) == []
    cache.release(h)
    evict_all_device(cache)  # now A may go: it is host-only, its host copy intact
    serve_manual(cache, a)
    assert cache.stats()["host_hit_tokens"] == len(a)
    settle(cache)


def test_write_back_frees_device_pages_only_after_the_backup_landed():
    cache = make_cache(device_pages=6, host_pages=16, policy="write_back")
    a = seq(100, 3)
    serve_manual(cache, a)
    assert pending(cache) == []  # write-back: nothing until eviction
    h = cache.match([])
    assert cache.alloc(h, 6 * P) is None  # A's backup started; its pages are not free yet
    (backup,) = pending(cache, TransferKind.BACKUP)
    a_pages = backup.device_pages.clone()
    got = cache.alloc(h, 3 * P)
    assert set(got.tolist()).isdisjoint(a_pages.tolist())
    complete(cache, TransferKind.BACKUP)
    reused = cache.alloc(h, 3 * P)  # A's old device pages, free only now
    assert sorted(reused.tolist()) == sorted(a_pages.tolist())
    other = seq(900, 6)
    kvcheck.write_kv(cache.device_pool, h.page_table(), other, 0, 6 * P)  # overwrite them
    cache.release(h)
    serve_manual(cache, a)  # loads A from its host copy: intact
    assert cache.stats()["host_hit_tokens"] == len(a)
    settle(cache)


def test_backup_never_reads_device_pages_before_the_compute_fence():
    cache = make_cache()
    fence = ManualFence()
    cache.transfers.compute_fence = lambda: fence  # the compute writing A is still running
    a = seq(100, 3)
    h = cache.match(a)
    cache.alloc(h, len(a))
    stale = seq(700, 3)  # what the pages held before the compute overwrote them
    kvcheck.write_kv(cache.device_pool, h.page_table(), stale, 0, len(a))
    cache.insert(h, a)
    (backup,) = pending(cache, TransferKind.BACKUP)
    assert not cache.transfers.executor.complete_layer(backup)
    assert backup.layers_done == 0
    cache.release(h)
    evict_all = cache.match([])
    assert cache.alloc(evict_all, cache.config.num_device_pages * P) is None  # A is in IO
    cache.release(evict_all)
    kvcheck.write_kv(cache.device_pool, backup.device_pages, a, 0, len(a))  # compute done
    fence.set()
    complete(cache, TransferKind.BACKUP)
    settle(cache)
    evict_all_device(cache)
    serve_manual(cache, a)
    settle(cache)


def test_write_back_chain_never_frees_host_pages_being_loaded():
    # load-back of A -> device eviction -> write-back backup of B -> host eviction,
    # which must take E's host pages, never A's (still being read by the load).
    cache = make_cache(device_pages=6, host_pages=6, policy="write_back")
    a, e = seq(100, 4), seq(200, 2)
    serve_manual(cache, a)
    serve_manual(cache, e)
    evict_all_device(cache)  # both backed up (evict-after), then freed
    complete(cache, TransferKind.BACKUP)
    evict_all_device(cache)
    assert cache.tree.host_tokens == len(a) + len(e) and cache.tree.device_tokens == 0
    h = cache.match(a)  # load of A in flight: 4 device pages
    (load,) = pending(cache, TransferKind.LOAD)
    a_host = set(load.host_pages.tolist())
    b = seq(300, 2)
    serve_manual(cache, b)  # device now full: A (loading) + B
    hc = cache.match(seq(400, 2))
    cache.alloc(hc, 2 * P)  # evicts B -> backup of B -> host eviction
    (backup,) = pending(cache, TransferKind.BACKUP)
    assert a_host.isdisjoint(backup.host_pages.tolist())
    assert cache.stats()["host_evicted_tokens"] == len(e)
    complete(cache, TransferKind.BACKUP)
    cache.release(hc)
    hc = cache.match(seq(400, 2))
    got = cache.alloc(hc, 2 * P)
    kvcheck.write_kv(cache.device_pool, got, seq(400, 2), 0, 2 * P)
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    cache.release(hc)
    # Host full of locked / in-flight pages: the backup is skipped and B is dropped.
    settle(cache)


def test_release_while_load_in_flight_keeps_the_load_safe():
    cache = make_cache(device_pages=6)
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a)
    cache.release(h)  # the request is aborted; its load is still copying
    cache.check_integrity()
    other = cache.match(seq(500, 6))
    assert cache.alloc(other, 6 * P) is None, "evicted pages a load is still writing"
    cache.release(other)
    complete(cache, TransferKind.LOAD)
    settle(cache)
    assert cache.match(a).device_len == len(a)


def test_release_then_failed_load_leaks_nothing():
    cache = make_cache(device_pages=6)
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a)
    cache.release(h)
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.complete_layer(load)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    assert cache.poll() == 1
    m = cache.tree.match_prefix(a)
    assert (m.device_len, m.host_len) == (0, len(a)), "a failed load must leave A host-only"
    settle(cache)


def test_second_match_during_a_load_shares_it():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    h1 = cache.match(a + [1, 1])
    h2 = cache.match(a + [2, 2])
    assert cache.stats()["loads"] == 1, "the same prefix was loaded twice"
    assert (h2.prefix_len, h2.host_len) == (len(a), 0)
    (load,) = pending(cache, TransferKind.LOAD)
    with pytest.raises(LoadError):
        h2.wait_layer(0)  # manual executor: not landed yet
    cache.transfers.executor.complete_layer(load)
    h2.wait_layer(0)
    with pytest.raises(LoadError):
        h2.wait_layer(1)
    cache.transfers.executor.complete_layer(load)
    for h, t in ((h1, a + [1, 1]), (h2, a + [2, 2])):
        assert cache.finish_loads(h)
        verify_prefix(cache, h, t)
        cache.alloc(h, len(t) - h.prefix_len)
        kvcheck.write_kv(cache.device_pool, h.page_table(), t, h.prefix_len, len(t))
        cache.insert(h, t)
        verify_prefix(cache, h, t)
        cache.release(h)
    settle(cache)


def test_failed_shared_load_cuts_back_every_waiting_request():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    h1 = cache.match(a)
    h2 = cache.match(a + [5, 5])
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    for h in (h1, h2):
        assert not cache.finish_loads(h)
        assert h.prefix_len == 0 and h.load_error is not None
    cache.check_integrity()
    for h in (h1, h2):
        cache.release(h)
    settle(cache)
    # The requests still held A when the failure landed: it was loaded again in place
    # from its intact host copy (a reload, not a request's load), correctly.
    hits = cache.stats()["device_hit_tokens"]
    serve_manual(cache, a)
    s = cache.stats()
    assert s["loads"] == 1 and s["device_hit_tokens"] - hits == len(a)


def test_split_while_a_load_is_in_flight():
    cache = make_cache()
    a = seq(100, 4)
    host_only(cache, a)
    h1 = cache.match(a)
    h2 = cache.match(a[: 2 * P] + [9, 9])  # splits A inside the load's node
    assert cache.tree.num_nodes == 2 and h2.prefix_len == 2 * P
    cache.check_integrity()
    with pytest.raises(LoadError):
        h2.wait_layer(0)
    complete(cache, TransferKind.LOAD)
    for h, t in ((h1, a), (h2, a[: 2 * P] + [9, 9])):
        assert cache.finish_loads(h)
        verify_prefix(cache, h, t)
        cache.release(h)
    settle(cache)


def test_split_while_a_load_fails():
    cache = make_cache()
    a = seq(100, 4)
    host_only(cache, a)
    h1 = cache.match(a)
    h2 = cache.match(a[: 2 * P] + [9, 9])
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.complete_layer(load)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    assert not cache.finish_loads(h1) and not cache.finish_loads(h2)
    assert h1.prefix_len == 0 and h2.prefix_len == 0
    cache.release(h1)
    cache.release(h2)
    settle(cache)
    # Both requests held A when the failure landed: both parts were loaded again in place.
    assert cache.tree.host_tokens == len(a) and cache.tree.device_tokens == len(a)
    assert kvcheck.verify_cache(cache) == []


def test_split_while_a_backup_is_in_flight():
    cache = make_cache()
    a = seq(100, 4)
    serve_manual(cache, a)
    h2 = cache.match(a[:P] + [9, 9])  # splits A while its backup copies
    cache.check_integrity()
    complete(cache, TransferKind.BACKUP)
    cache.release(h2)
    settle(cache)
    assert cache.tree.host_tokens == len(a)


def test_split_hook_is_installed_only_while_something_is_tracked():
    cache = make_cache()
    assert cache.tree.on_split is None  # nothing in flight: splits need no bookkeeping
    a = seq(100, 4)
    h = cache.match(a)
    cache.alloc(h, len(a))
    cache.insert(h, a)  # write-through: the backup is in flight (manual executor)
    assert cache.tree.on_split is not None
    h2 = cache.match(a[:P] + [9, 9])  # a split the in-flight backup must see
    complete(cache, TransferKind.BACKUP)
    assert cache.tree.on_split is None
    for x in (h, h2):
        cache.release(x)
    cache.check_integrity()
    assert cache.tree.host_tokens == len(a) and cache.tree.device_tokens == len(a)


def test_write_back_eviction_frees_every_part_of_a_node_split_in_flight():
    cache = make_cache(device_pages=6, policy="write_back")
    a = seq(100, 6)
    serve_manual(cache, a)
    h = cache.match([])
    assert cache.alloc(h, 6 * P) is None  # backup of A started, evict after it lands
    h2 = cache.match(a[: 2 * P] + [9, 9])  # split A -> P2 | rest
    h3 = cache.match(a[: 4 * P] + [9, 9])  # split rest -> P4 | tail
    cache.release(h2)
    cache.release(h3)
    complete(cache, TransferKind.BACKUP)
    assert cache.tree.device_tokens == 0, "write-back eviction left split parts on the device"
    assert cache.alloc(h, 6 * P) is not None
    cache.release(h)
    settle(cache)


def test_insert_over_a_node_being_loaded_waits_for_the_load():
    # h2 computed A itself; inserting it dedups onto A's pages, still being loaded.
    cache = make_cache()
    a = seq(100, 3)
    t2 = a + seq(50, 1)
    h2 = cache.match(t2)  # before A exists: nothing matched
    host_only(cache, a)
    h1 = cache.match(a)
    cache.alloc(h2, len(t2))
    kvcheck.write_kv(cache.device_pool, h2.page_table(), t2, 0, len(t2))
    cache.insert(h2, t2)
    with pytest.raises(LoadError):
        h2.wait_layer(0)  # reading A's pages now would read what the load has not written
    complete(cache, TransferKind.LOAD)
    for layer in range(KV_F16.num_layers):
        h2.wait_layer(layer)
    verify_prefix(cache, h2, t2)
    for h in (h1, h2):
        cache.release(h)
    settle(cache)


def test_load_failure_applied_while_another_load_allocates():
    # B's load-back evicts (write-back backup -> poll), and the poll applies the
    # failure of A's load, which B's request depends on: B's load must not start
    # under a node that just lost its device copy.
    cache = make_cache(device_pages=6, host_pages=16, policy="write_back")
    a, b = seq(100, 2), seq(200, 2)
    serve_manual(cache, a + b)
    evict_all_device(cache)
    complete(cache, TransferKind.BACKUP)
    evict_all_device(cache)
    h1 = cache.match(a)  # A loads (2 pages)
    (load_a,) = pending(cache, TransferKind.LOAD)
    serve_manual(cache, seq(300, 2))  # a device-only leaf for the eviction to back up
    serve_manual(cache, seq(400, 2))
    executor = cache.transfers.executor
    submit = executor.submit

    def fail_a_on_backup(handle):
        submit(handle)
        if handle.kind is TransferKind.BACKUP and load_a in executor.pending():
            executor.fail(load_a, RuntimeError("injected"))

    executor.submit = fail_a_on_backup
    h2 = cache.match(a + b)  # waits on A, loads B: needs 2 pages -> eviction
    executor.submit = submit
    cache.check_integrity()
    assert not cache.finish_loads(h2) and h2.prefix_len == 0
    assert not cache.finish_loads(h1) and h1.prefix_len == 0
    cache.release(h1)
    cache.release(h2)
    settle(cache)
    serve_manual(cache, a + b)
    settle(cache)


def test_no_lock_leaks_after_every_request_finishes():
    cache = make_cache(device_pages=10, host_pages=20)
    prompts = [seq(100, 3), seq(100, 2) + seq(7, 2), seq(100, 1) + seq(30, 3), seq(200, 2)]
    handles = []
    for i in range(12):
        t = prompts[i % len(prompts)] + [i, i]
        h = cache.match(t, "ns" if i % 3 == 0 else None)
        handles.append((h, t, "ns" if i % 3 == 0 else None))
        if i % 4 == 3:
            complete(cache)
            for hh, tt, ns in handles:
                if not cache.finish_loads(hh):
                    continue
                if cache.alloc(hh, len(tt) - hh.prefix_len) is not None:
                    kvcheck.write_kv(cache.device_pool, hh.page_table(), tt, hh.prefix_len,
                                     len(tt), ns)
                    cache.insert(hh, tt)
                    verify_prefix(cache, hh, tt, ns)
                cache.release(hh)
            handles = []
            evict_all_device(cache)
            cache.check_integrity()
    for hh, _, _ in handles:
        cache.release(hh)
    settle(cache)


def test_eviction_never_evicts_more_than_asked():
    cache = make_cache(device_pages=12, host_pages=24)
    for i in range(4):
        serve_manual(cache, seq(100 * (i + 1), 3))
    complete(cache, TransferKind.BACKUP)
    assert cache.stats()["device_pages_free"] == 0
    h = cache.match([])
    before = cache.stats()["device_evicted_tokens"]
    assert cache.alloc(h, 2 * P) is not None  # evicts the LRU leaf's tail only
    assert cache.stats()["device_evicted_tokens"] - before == 2 * P
    assert cache.stats()["device_pages_free"] == 0
    assert cache.tree.match_prefix(seq(100, 3)).device_len == P  # its head stays
    assert cache.tree.match_prefix(seq(200, 3)).device_len == 3 * P
    assert cache.alloc(h, 1) is not None
    assert cache.stats()["device_evicted_tokens"] - before == 3 * P
    cache.release(h)
    settle(cache)


def test_write_back_eviction_never_evicts_more_than_asked():
    cache = make_cache(device_pages=12, host_pages=24, policy="write_back")
    for i in range(4):
        serve_manual(cache, seq(100 * (i + 1), 3))
    h = cache.match([])
    assert cache.alloc(h, 2 * P) is None  # manual executor: backups pending
    (backup,) = pending(cache, TransferKind.BACKUP)
    # The leaf's 2-page tail is evicted; the 1-page part split off above it is backed
    # up with it (a host copy implies host copies of every ancestor) and stays.
    assert backup.num_pages == 3
    complete(cache, TransferKind.BACKUP)
    assert cache.stats()["device_pages_free"] == 2, "evicted more than the eviction asked for"
    assert cache.alloc(h, 2 * P) is not None
    cache.release(h)
    settle(cache)


def test_namespaces_never_share_kv_across_loads():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a, "tenant-1")
    serve_manual(cache, a, "tenant-2")  # same tokens, other namespace: a miss, computed
    assert cache.stats()["host_hit_tokens"] == 0
    serve_manual(cache, a, "tenant-1")  # loads tenant-1's own KV
    assert cache.stats()["host_hit_tokens"] == len(a)
    settle(cache)

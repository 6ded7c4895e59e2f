"""Fault injection: failed loads and backups, exhausted pools, polling after failures.

The contract under test: a fault never loses what was cached on the device,
never leaks a page or a lock, and a failed load tells the caller exactly which
tokens to recompute (``h.prefix_len`` is cut back, ``h.load_error`` set).
"""

from __future__ import annotations

from functools import partial

import pytest
from kv_layouts import KV, TREE_KINDS, P, seq
from leak_checks import assert_no_leaks, complete_transfers
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
from serving import serve

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.sim import kvcheck
from hicache.sim.faults import FaultyCopier, InjectedFault, install_copier
from hicache.transfer import TransferKind
from hicache.tree import IOStatus


def kvcheck_key(tokens: list[int]) -> bytes:
    from hicache.tree import token_key

    return token_key(tokens, P)


def device_snapshot(cache: HiCache) -> set[tuple]:
    """(namespace, tokens) of every path whose KV sits on the device and is readable."""
    out = set()
    for node in cache.tree.nodes():
        if node.on_device and node.io_status is not IOStatus.LOADING:
            out.add((node.namespace, tuple(kvcheck.path_tokens(node).tolist())))
    return out


def assert_still_on_device(cache: HiCache, snapshot: set[tuple]) -> None:
    for ns, tokens in snapshot:
        m = cache.tree.match_prefix(list(tokens), ns)
        assert m.device_len == len(tokens), f"{ns!r} {tokens}: lost from the device by a fault"
    assert kvcheck.verify_cache(cache) == []


@pytest.mark.parametrize("layers_landed", [0, 1])
def test_failed_load_cuts_the_request_back_and_it_recomputes(layers_landed):
    cache = make_cache()
    stem, a = seq(100, 2), seq(300, 2)
    serve_manual(cache, stem)
    host_only(cache, stem + a)
    serve_manual(cache, stem)  # the stem back on the device, A host-only below it
    kept = device_snapshot(cache)
    h = cache.match(stem + a + [7])
    assert h.prefix_len == len(stem + a)
    (load,) = pending(cache, TransferKind.LOAD)
    for _ in range(layers_landed):
        cache.transfers.executor.complete_layer(load)
    cache.transfers.executor.fail(load, RuntimeError("injected DMA error"))
    assert not cache.finish_loads(h)
    assert h.prefix_len == len(stem), "prefix not cut back above the failed load"
    assert isinstance(h.load_error, RuntimeError)
    node = cache.tree.probe_path(kvcheck_key(stem + a))[-1]
    # h still held A when the failure landed (it is applied only by h's own call):
    # A's device pages are loaded again in place, nobody else received them.
    assert node.on_device and node.on_host and node.host_lock_ref == 1
    assert node.io_status is IOStatus.LOADING and node.lock_ref == 0
    cache.check_integrity()
    assert_still_on_device(cache, kept)
    # The caller recomputes from h.prefix_len.
    tokens = stem + a + [7]
    assert cache.alloc(h, len(tokens) - h.prefix_len) is not None
    kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, len(tokens))
    cache.insert(h, tokens)  # A is cached (being reloaded): h waits on that load
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h) and h.load_error is None
    verify_prefix(cache, h, tokens)
    cache.release(h)
    s = cache.stats()
    assert (s["loads"], s["loads_failed"]) == (2, 1)  # the stem, then A (the reload not counted)
    settle(cache)
    assert cache.tree.match_prefix(stem + a).device_len == len(stem + a)


def test_failed_load_frees_the_pages_the_request_had_allocated():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    h = cache.match(a + seq(50, 2))
    assert cache.alloc(h, 2 * P) is not None
    assert h.num_owned_pages == 2
    used = cache.stats()["device_pages_used"]
    (load,) = pending(cache, TransferKind.LOAD)
    cache.transfers.executor.fail(load, RuntimeError("injected"))
    assert not cache.finish_loads(h)
    assert h.num_owned_pages == 0, "pages computed on top of a failed load were kept"
    assert cache.stats()["device_pages_used"] == used - 2  # A's 3 pages are being reloaded
    cache.release(h)
    settle(cache)


def test_failed_backup_frees_host_pages_and_keeps_the_node_on_device():
    cache = make_cache()
    a = seq(100, 3)
    serve_manual(cache, a)
    (backup,) = pending(cache, TransferKind.BACKUP)
    kept = device_snapshot(cache)
    cache.transfers.executor.fail(backup, RuntimeError("injected"))
    assert cache.poll() == 1
    s = cache.stats()
    assert s["backups_failed"] == 1 and s["host_pages_used"] == 0 and s["backup_bytes"] == 0
    node = cache.tree.match_prefix(a).last_node
    assert node.on_device and not node.on_host
    assert_still_on_device(cache, kept)
    settle(cache)
    serve_manual(cache, a + seq(50, 1))  # the next insert through the path backs it up again
    complete(cache, TransferKind.BACKUP)
    assert cache.tree.match_prefix(a).last_node.on_host
    settle(cache)


def test_failed_write_back_backup_keeps_the_evicted_node_on_device():
    cache = make_cache(device_pages=6, policy="write_back")
    a = seq(100, 3)
    serve_manual(cache, a)
    kept = device_snapshot(cache)
    h = cache.match([])
    assert cache.alloc(h, 6 * P) is None  # eviction started A's backup
    (backup,) = pending(cache, TransferKind.BACKUP)
    cache.transfers.executor.complete_layer(backup)
    cache.transfers.executor.fail(backup, RuntimeError("injected"))
    cache.release(h)
    assert_still_on_device(cache, kept)
    assert cache.stats()["device_evicted_tokens"] == 0
    settle(cache)


def test_device_exhaustion_mid_request_is_a_normal_return():
    cache = make_cache(device_pages=6)
    h1 = cache.match(seq(100, 4))
    assert cache.alloc(h1, 4 * P) is not None
    h2 = cache.match(seq(200, 4))
    assert cache.alloc(h2, 2 * P) is not None
    before = cache.stats()
    assert cache.alloc(h2, 1) is None, "allocated beyond the pool"
    assert cache.stats() == before, "a failed allocation changed the cache"
    assert h2.num_owned_pages == 2
    cache.release(h1)
    assert cache.alloc(h2, 2 * P) is not None
    cache.release(h2)
    settle(cache)


def test_load_refused_when_the_device_is_full_counts_a_miss():
    cache = make_cache(device_pages=6)
    a = seq(100, 3)
    host_only(cache, a)
    hog = cache.match(seq(200, 6))
    assert cache.alloc(hog, 6 * P) is not None
    h = cache.match(a)
    s = cache.stats()
    assert h.prefix_len == 0 and h.host_len == len(a)
    assert s["loads_refused_no_space"] == 1 and s["host_hit_refused_tokens"] == len(a)
    assert s["loads"] == 0 and pending(cache) == []
    cache.release(hog)
    assert cache.load_back(h) is not None  # room now: the same handle loads
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    settle(cache)


def test_host_exhaustion_skips_the_backup_and_counts_it():
    cache = make_cache(device_pages=12, host_pages=3)
    a, b = seq(100, 3), seq(200, 3)
    host_only(cache, a)
    h = cache.match(a)  # A's host pages locked by its load: nothing evictable on the host
    serve_manual(cache, b)
    s = cache.stats()
    assert s["backups_skipped"] == 1 and s["backups"] == 1
    node = cache.tree.match_prefix(b).last_node
    assert node.on_device and not node.on_host
    complete(cache, TransferKind.LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    settle(cache)


def test_poll_after_failures_applies_each_once():
    cache = make_cache()
    a, b = seq(100, 3), seq(200, 3)
    host_only(cache, a)
    serve_manual(cache, b)  # backup of B pending
    h = cache.match(a)  # load of A pending
    ex = cache.transfers.executor
    for t in pending(cache):
        ex.fail(t, RuntimeError("injected"))
    # stats() polls: both failures applied; A is reloaded (h still held it then)
    assert cache.stats()["transfers_in_flight"] == 1
    assert cache.poll() == 0
    s = cache.stats()
    assert (s["loads_failed"], s["backups_failed"]) == (1, 1)
    # h's own call applies its failure, once
    assert h.prefix_len == 3 * P and h.load_error is None
    assert not cache.finish_loads(h)
    assert h.prefix_len == 0 and h.load_error is not None
    assert cache.finish_loads(h) and h.load_error is None  # reported once
    cache.release(h)
    settle(cache)


def test_every_transfer_failing_loses_nothing_cached_on_device():
    cache = make_cache(device_pages=10, host_pages=20)
    prompts = [seq(100, 2), seq(100, 2) + seq(30, 2), seq(200, 3)]
    for t in prompts:
        serve_manual(cache, t)
    complete(cache, TransferKind.BACKUP)
    evict_all_device(cache)
    serve_manual(cache, seq(100, 2))
    kept = device_snapshot(cache)
    handles = [cache.match(t) for t in prompts]
    ex = cache.transfers.executor
    for t in pending(cache):
        ex.fail(t, RuntimeError("injected"))
    cache.poll()
    assert_still_on_device(cache, kept)
    for h in handles:
        cache.finish_loads(h)  # each request's failure is applied by its own call
        assert h.load_error is not None or h.prefix_len == h.device_len
        cache.release(h)
    settle(cache)


def test_failed_loads_on_the_thread_executor_recover():
    cfg = CacheConfig(KV_F16, device_tokens=8 * P, host_tokens=16 * P, executor="thread",
                      host_reserve_nbytes=0)
    with HiCache(cfg) as cache:
        copier = install_copier(cache, FaultyCopier.wrap(cache, seed=0, fault_rate=1.0))
        copier.fault_rate = 0.0
        a = seq(100, 3)
        h = cache.match(a)
        cache.alloc(h, len(a))
        kvcheck.write_kv(cache.device_pool, h.page_table(), a, 0, len(a))
        cache.insert(h, a)
        cache.release(h)
        cache.wait_all()
        evict_all_device(cache)
        copier.fault_rate = 1.0  # every copy from now on fails
        h = cache.match(a)
        assert not cache.finish_loads(h) and h.prefix_len == 0
        cache.release(h)
        cache.wait_all()
        cache.check_integrity()
        # h held A when its load failed: A was loaded again in place, and failed again
        assert cache.stats()["loads_failed"] == 2
        copier.fault_rate = 0.0
        h = cache.match(a)
        assert cache.finish_loads(h)
        verify_prefix(cache, h, a)
        cache.release(h)
        cache.wait_all()
        cache.check_integrity()
        assert kvcheck.verify_cache(cache) == []


@pytest.mark.parametrize("tree", TREE_KINDS)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_host_tier_whose_copies_always_fail_degrades_to_recompute(policy, tree):
    """Write-back refused every request once the device was full: each eviction started a
    backup that failed, so no page came free (issue 25.7). Now, as under write-through,
    every request is served; the unbacked pages are dropped, counted, and recomputed."""
    cfg = CacheConfig(KV_F16, device_tokens=8 * P, host_tokens=16 * P, executor="thread",
                      host_reserve_nbytes=0, write_policy=policy, tree=tree)
    with HiCache(cfg) as cache:
        copier = install_copier(cache, FaultyCopier.wrap(cache, seed=0, fault_rate=1.0))
        prompts = [seq(100 * (i + 1), 3) for i in range(6)] + [seq(100, 3)]  # the first again
        for i, tokens in enumerate(prompts):
            h = cache.match(tokens)
            assert h.prefix_len == 0, "a dropped prefix must miss (its KV is gone)"
            pages = cache.alloc(h, len(tokens))
            assert pages is not None, f"request {i} refused ({policy})"
            kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, 0, len(tokens))
            assert cache.insert(h, tokens) == len(tokens)
            cache.release(h)
            cache.wait_all()
            cache.check_integrity()
        s = cache.stats()
        # 7 requests of 3 pages each; the device holds the last 8 pages, the host nothing.
        assert s["device_pages_used"] == 8 and s["device_cached_tokens"] == 8 * P
        assert s["host_pages_used"] == 0 and s["host_cached_tokens"] == 0
        assert s["device_evicted_tokens"] == (7 * 3 - 8) * P
        if policy == "write_back":  # the evicted tokens are exactly the dropped ones
            assert s["unbacked_dropped_tokens"] == (7 * 3 - 8) * P
            assert s["backups_failed"] == copier.num_faults["backup"] > 0
        else:  # write-through drops device-only leaves as plain eviction does
            assert s["unbacked_dropped_tokens"] == 0 and s["backups_failed"] == 7
        assert copier.num_faults["load"] == 0 and s["loads"] == 0
        assert kvcheck.verify_cache(cache) == []
        assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_a_transient_write_back_failure_drops_nothing(tree):
    """One failed eviction backup is offered again by the next round and lands: the
    evicted pages keep their host copy and nothing is dropped."""
    cfg = CacheConfig(KV_F16, device_tokens=6 * P, host_tokens=16 * P, executor="thread",
                      host_reserve_nbytes=0, write_policy="write_back", tree=tree)
    with HiCache(cfg) as cache:
        copier = install_copier(cache, FaultyCopier.wrap(cache, seed=0))
        a, b = seq(100, 3), seq(200, 3)
        for tokens in (a, b):
            h = cache.match(tokens)
            assert cache.alloc(h, len(tokens)) is not None
            kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, 0, len(tokens))
            cache.insert(h, tokens)
            cache.release(h)
        fail_once = copier.backup

        def backup(*args):
            copier.backup = fail_once
            raise InjectedFault("one failed backup")

        copier.backup = backup
        h = cache.match(seq(300, 3))
        assert cache.alloc(h, 3 * P) is not None
        cache.release(h)
        cache.wait_all()
        s = cache.stats()
        assert s["backups_failed"] == 1 and s["unbacked_dropped_tokens"] == 0
        assert s["device_evicted_tokens"] == 3 * P and s["host_cached_tokens"] == 3 * P
        h = cache.match(a)  # back from the host tier
        assert h.prefix_len == len(a) and cache.finish_loads(h)
        verify_prefix(cache, h, a)
        cache.release(h)
        cache.wait_all()
        assert kvcheck.verify_cache(cache) == []
        assert_no_leaks(cache)


# A full hit only matches (no alloc, no insert): repeating a request repeats its match alone.
serve_skipping_hits = partial(serve, skip_cached=True)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_selective_backup_in_match_does_not_evict_the_host_part_being_loaded(tree):
    # write_through_selective backs up the matched device path inside match(); its host
    # allocation used to evict the host-only continuation of that same match first.
    # Since a host copy implies host copies of every ancestor, A's failed backup is
    # retried (B has a host copy) and the state (device-only A above host-only B) that
    # made this possible cannot arise; the test now checks the retry and the load.
    cache = HiCache(CacheConfig(KV, device_tokens=16, host_tokens=8, executor="manual",
                                write_policy="write_through_selective",
                                backup_hit_threshold=2, tree=tree))
    ex = cache.transfers.executor
    a, ab = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    for _ in range(3):
        serve_skipping_hits(cache, a)  # the third reaches the threshold: A's backup in flight
    node_a = cache.tree.match_prefix(a).last_node
    rec_a = cache._inflight.by_node[node_a]
    for _ in range(3):
        serve_skipping_hits(cache, ab)  # B (child of A) backed up; A still in flight
    (node_b,) = node_a.children.values()
    ex.complete(cache._inflight.by_node[node_b].handle)
    ex.fail(rec_a.handle, RuntimeError("injected backup failure"))
    cache.poll()
    assert node_a.on_host and cache._inflight.by_node[node_a] is not rec_a  # retried
    assert cache.stats()["backups_retried"] == 1
    cache.check_integrity()
    for _ in range(3):
        serve_skipping_hits(cache, [50, 51])
    complete_transfers(cache)
    hx = cache.match([100, 101])
    assert cache.alloc(hx, 10) is not None  # pushes B off the device
    cache.release(hx)
    assert node_b.on_host and not node_b.on_device
    h = cache.match(ab)
    assert (h.device_len, h.host_len, h.prefix_len) == (4, 2, 6)
    cache.release(h)
    complete_transfers(cache)
    cache.check_integrity()
    cache.close()

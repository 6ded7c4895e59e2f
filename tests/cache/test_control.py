"""HiCache.reset and pins: exact page accounting, IO in flight, the pin budget, bad input."""

from __future__ import annotations

import math

import pytest
from kv_layouts import KV_TINY, TREE_KINDS
from leak_checks import assert_no_leaks
from serving import bookkeeping, serve

from hicache.cache import HiCache, ResetResult
from hicache.config import CacheConfig
from hicache.storage.file import FileStorage

A, B = [1] * 6, [2] * 4


CONFIGS = [(t, lc) for t in TREE_KINDS for lc in ("python", "auto")]


# ------------------------------------------------------------------- reset
@pytest.mark.parametrize(("tree", "lifecycle"), CONFIGS)
def test_reset_drops_everything_but_what_a_live_request_holds(tree, lifecycle):
    cache = bookkeeping(tree, lifecycle)
    serve(cache, A)  # 3 pages on the device, backed up to the host (write-through)
    serve(cache, B)  # 2 more
    h = cache.match(B + [3, 3])  # holds B's 2 pages
    assert h.prefix_len == 4 and cache.alloc(h, 2) is not None  # owns 1 page more
    r = cache.reset()
    # A: 6 tokens off the device, then its host copy; B: its host copy only (locked on device).
    assert r == ResetResult(6, 10, 4, 0, 0, 0, None)
    assert not r.complete
    assert cache.device_allocator.num_used_pages == 3  # B's 2 + the 1 h owns
    assert cache.host_allocator.num_used_pages == 0
    assert cache.tree.match_prefix(A).device_len + cache.tree.match_prefix(A).host_len == 0
    cache.check_integrity()
    cache.insert(h, B + [3, 3])
    cache.release(h)
    r = cache.reset()
    assert r == ResetResult(6, 6, 0, 0, 0, 0, None) and r.complete  # insert backed it all up
    assert cache.device_allocator.num_used_pages == 0 and cache.tree.num_nodes == 0
    assert_no_leaks(cache)
    serve(cache, A)  # the cache works on after a reset
    assert cache.tree.match_prefix(A).device_len == 6
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_reset_without_host_tier_and_with_write_back(tree):
    cache = bookkeeping(tree, host_tokens=None)
    serve(cache, A)
    serve(cache, B)
    assert cache.reset() == ResetResult(10, 0, 0, 0, 0, 0, None)
    assert_no_leaks(cache)
    cache = bookkeeping(tree, write_policy="write_back", device_tokens=8)
    serve(cache, A)
    serve(cache, B)  # evicts A's tail to the host (write-back)
    before = (cache.tree.device_tokens, cache.tree.host_tokens)
    r = cache.reset()
    assert (r.dropped_device_tokens, r.dropped_host_tokens) == before
    assert r.complete and cache.stats()["backups"] == 1  # reset started no backup
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_reset_keeps_nodes_with_io_in_flight_then_drops_them(tree):
    cache = HiCache(
        CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, executor="manual", tree=tree)
    )
    h = cache.match(A)
    cache.alloc(h, 6)
    cache.insert(h, A)  # write-through backup of A, in flight
    cache.release(h)
    (backup,) = cache.transfers.executor.pending()
    r = cache.reset()
    assert r == ResetResult(0, 0, 6, 6, 0, 0, None)  # BACKING_UP: neither copy may go
    cache.check_integrity()
    cache.transfers.executor.complete(backup)
    r = cache.reset()
    assert r == ResetResult(6, 6, 0, 0, 0, 0, None)
    assert_no_leaks(cache)
    cache.close()


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_reset_keeps_a_load_in_flight_and_its_host_copy(tree):
    cache = HiCache(
        CacheConfig(KV_TINY, device_tokens=8, host_tokens=32, executor="manual", tree=tree)
    )
    h = cache.match(A)
    cache.alloc(h, 6)
    cache.insert(h, A)
    cache.release(h)
    cache.transfers.executor.complete(cache.transfers.executor.pending()[0])
    serve_manual = cache.match(B)
    cache.alloc(serve_manual, 4)  # evicts part of A to the host
    cache.insert(serve_manual, B)
    cache.release(serve_manual)
    for t in cache.transfers.executor.pending():
        cache.transfers.executor.complete(t)
    cache.poll()
    g = cache.match(A)  # loads A's host-only part back: a load in flight
    assert g.host_len > 0 and cache.transfers.num_in_flight == 1
    r = cache.reset()
    # B goes (its device page left, then its host copy); A stays whole in both tiers:
    # locked on the device, and its host copies end in the leaf being loaded.
    assert r == ResetResult(2, 4, 6, 6, 0, 0, None)
    cache.check_integrity()
    cache.transfers.executor.complete(cache.transfers.executor.pending()[0])
    assert cache.finish_loads(g)
    cache.release(g)
    assert cache.reset().complete
    assert_no_leaks(cache)
    cache.close()


def test_reset_clears_storage_only_when_asked(tmp_path):
    cfg = CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, storage=f"file:{tmp_path}",
                      model_id="m", executor="thread", tree="python")
    with HiCache(cfg) as cache:
        h = cache.match(A)
        cache.alloc(h, 6)
        cache.insert(h, A)
        cache.release(h)
        cache.wait_all()
        for job in list(cache._inflight.storage_pins.values()):
            job.done.wait()
        cache.poll()
        store = cache.storage.backend
        assert isinstance(store, FileStorage)
        keys = cache._third_tier.page_keys(cache.tree.match_prefix(A).last_node.key, None)
        assert store.exists(keys) == 3
        r = cache.reset()
        assert r.storage_pages_deleted is None and store.exists(keys) == 3
        assert r.complete
        r = cache.reset(storage=True)
        assert r.storage_pages_deleted == 3 and store.exists(keys) == 0
        assert_no_leaks(cache)


def test_reset_discards_storage_reads_in_flight(tmp_path):
    cfg = CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, storage=f"file:{tmp_path}",
                      model_id="m", executor="thread", tree="python")
    with HiCache(cfg) as writer:
        serve(writer, A)
        writer.wait_all()
        for job in list(writer._inflight.storage_pins.values()):
            job.done.wait()
        writer.poll()
    with HiCache(cfg) as cache:
        job = cache.prefetch(A)  # all 3 pages only storage holds
        assert job is not None
        r = cache.reset()
        assert r.discarded_prefetches == 1
        job.done.wait()
        cache.poll()
        assert cache.tree.num_nodes == 0 and cache.host_allocator.num_used_pages == 0
        assert_no_leaks(cache)


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_reset_bad_input(bad):
    cache = bookkeeping("python")
    serve(cache, A)
    with pytest.raises(TypeError, match="storage"):
        cache.reset(storage=bad)
    assert cache.tree.device_tokens == 6
    assert_no_leaks(cache)


# -------------------------------------------------------------------- pins
@pytest.mark.parametrize(("tree", "lifecycle"), CONFIGS)
def test_pin_keeps_a_prefix_through_eviction_pressure(tree, lifecycle):
    cache = bookkeeping(tree, lifecycle, host_tokens=None, device_tokens=16)
    serve(cache, A)
    assert cache.pin(A) == 6
    assert cache.pinned_device_tokens() == 6
    for i in range(5):  # 8 pages: 3 pinned, 5 cycle through other prompts
        serve(cache, [10 + i] * 10)
    assert cache.tree.match_prefix(A).device_len == 6
    cache.check_integrity()
    s = cache.stats()
    assert (s["pins"], s["pinned_device_tokens"]) == (1, 6)
    h = cache.match([99] * 10)  # 5 pages: exactly what the pins leave
    assert cache.alloc(h, 10) is not None
    cache.release(h)
    assert cache.unpin(A) is True and cache.unpin(A) is False
    h = cache.match([98] * 16)  # the whole tier: the unpinned prefix goes too
    assert cache.alloc(h, 16) is not None
    assert cache.tree.match_prefix(A).device_len == 0
    cache.release(h)
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_pin_budget_is_a_fraction_of_the_device_tier(tree):
    cache = bookkeeping(tree, max_pinned_fraction=0.25)  # 8 pages: 2 may be pinned
    assert cache.max_pinned_tokens == 4
    serve(cache, A)
    serve(cache, B)
    assert cache.pin(A) == 0  # 3 pages: over budget, nothing pinned
    assert cache.stats()["pins_refused"] == 1 and cache.pinned_device_tokens() == 0
    assert cache.pin(B) == 4
    assert cache.pin(A[:2]) == 0  # one more page would exceed it
    assert cache.pin(B[:2]) == 2  # shares B's first page: still 4 tokens pinned
    assert cache.pinned_device_tokens() == 4
    cache.check_integrity()
    cache.unpin(B)
    cache.unpin(B[:2])
    assert_no_leaks(cache)
    zero = bookkeeping(tree, max_pinned_fraction=0)
    serve(zero, A)
    assert zero.pin(A) == 0
    assert_no_leaks(zero)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_pin_again_replaces_and_ttl_expires(tree):
    cache = bookkeeping(tree)
    clock = [100.0]
    cache._pins.now = lambda: clock[0]
    serve(cache, A[:4])
    assert cache.pin(A, ttl_s=5) == 4  # only 4 of A's tokens are cached
    serve(cache, A)
    assert cache.pin(A, ttl_s=5) == 6  # replaced: now the whole prefix, one lock
    assert cache.stats()["pins"] == 1
    assert cache.tree.match_prefix(A).last_device_node.lock_ref == 1
    clock[0] = 104.9
    h = cache.match([7] * 2)
    cache.alloc(h, 2)
    assert cache.stats()["pins"] == 1
    clock[0] = 105.0  # the deadline: expired at the next call that looks
    cache.alloc(h, 2)
    assert cache.stats()["pins"] == 0 and cache.tree.device_protected_tokens == 0
    cache.release(h)
    assert_no_leaks(cache)


# Every public call that may change state, as (name, call(cache, h)); h is a live handle
# matched on other tokens before the pin expired.
PUBLIC_CALLS = [
    ("match", lambda c, h: c.release(c.match(B))),
    ("load_back", lambda c, h: c.load_back(h)),
    ("finish_loads", lambda c, h: c.finish_loads(h)),
    ("alloc", lambda c, h: c.alloc(h, 2)),
    ("insert", lambda c, h: c.insert(h, B[:0])),
    ("release", lambda c, h: c.release(h)),
    ("poll", lambda c, h: c.poll()),
    ("wait_all", lambda c, h: c.wait_all()),
    ("prefetch", lambda c, h: c.prefetch(B)),
    ("take_events", lambda c, h: c.take_events()),
    ("pin", lambda c, h: c.pin(B)),
    ("unpin", lambda c, h: c.unpin(B)),
    ("pinned_device_tokens", lambda c, h: c.pinned_device_tokens()),
    ("stats", lambda c, h: c.stats()),
]


@pytest.mark.parametrize(("tree", "lifecycle"), CONFIGS)
@pytest.mark.parametrize("call", [c for _, c in PUBLIC_CALLS], ids=[n for n, _ in PUBLIC_CALLS])
def test_an_expired_pin_is_released_by_every_public_call(tree, lifecycle, call):
    """Expired pins were released only by alloc/pin/unpin: until then they held their lock
    and stats()["pins"] counted them (issue 25.10)."""
    cache = bookkeeping(tree, lifecycle)
    clock = [100.0]
    cache._pins.now = lambda: clock[0]
    serve(cache, A)
    assert cache.pin(A, ttl_s=5) == 6
    node = cache.tree.match_prefix(A).last_device_node
    h = cache.match(B)
    clock[0] = 104.9
    cache.poll()
    assert len(cache._pins) == 1 and node.lock_ref == 1  # not yet
    clock[0] = 105.0
    call(cache, h)
    assert len(cache._pins) == 0 and node.lock_ref == 0  # released by the call itself
    assert cache.tree.device_protected_tokens == (0 if h.released else h.prefix_len)
    cache.check_integrity()
    if not h.released:
        cache.release(h)
    s = cache.stats()
    assert s["pins"] == 0 and s["pinned_device_tokens"] == 0
    assert s["device_pages_used"] == 3  # A's 3 pages, unpinned and still cached
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_pins_expire_in_deadline_order_and_unpin_keeps_the_rest(tree):
    cache = bookkeeping(tree)
    clock = [0.0]
    cache._pins.now = lambda: clock[0]
    serve(cache, A)
    serve(cache, B)
    assert cache.pin(A[:4], ttl_s=10) == 4 and cache.pin(B[:2], ttl_s=2) == 2
    assert cache.pin(A[:2]) == 2  # no time-to-live: stays
    assert cache.pinned_device_tokens() == 6  # A[:2] shares A[:4]'s first page
    assert cache.unpin(B[:2])  # the earliest deadline goes; the next one still holds
    clock[0] = 9.9
    assert cache.stats()["pins"] == 2
    clock[0] = 10.0
    assert cache.stats()["pins"] == 1 and cache.pinned_device_tokens() == 2
    clock[0] = 1e9
    assert cache.stats()["pins"] == 1
    assert cache.unpin(A[:2])
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_pin_of_nothing_cached_and_namespaces(tree):
    cache = bookkeeping(tree)
    assert cache.pin(A) == 0 and cache.stats()["pins"] == 0
    h = cache.match(A, "t")
    cache.alloc(h, 6)
    cache.insert(h, A)
    cache.release(h)
    assert cache.pin(A) == 0  # cached only in namespace "t"
    assert cache.pin(A, "t") == 6
    assert cache.unpin(A) is False and cache.unpin(A, "t") is True
    assert_no_leaks(cache)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_reset_drops_pins(tree):
    cache = bookkeeping(tree)
    serve(cache, A)
    cache.pin(A)
    r = cache.reset()
    assert r.dropped_pins == 1 and r.complete and cache.stats()["pins"] == 0
    assert_no_leaks(cache)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ttl_s": 0}, ValueError, "ttl_s"),
        ({"ttl_s": -1.0}, ValueError, "ttl_s"),
        ({"ttl_s": math.inf}, ValueError, "ttl_s"),
        ({"ttl_s": math.nan}, ValueError, "ttl_s"),
        ({"ttl_s": True}, TypeError, "ttl_s"),
        ({"ttl_s": "5"}, TypeError, "ttl_s"),
        ({"namespace": 5}, TypeError, "namespace"),
        ({"tokens": [1.5, 2.0]}, TypeError, "tokens"),
        ({"tokens": [-1, 2]}, ValueError, "tokens"),
        ({"tokens": "abcd"}, TypeError, "tokens"),
    ],
)
def test_pin_bad_input_changes_nothing(kwargs, error, match):
    cache = bookkeeping("python")
    serve(cache, A)
    tokens, namespace = kwargs.get("tokens", A), kwargs.get("namespace")
    with pytest.raises(error, match=match):
        cache.pin(tokens, namespace, kwargs.get("ttl_s"))
    if "ttl_s" not in kwargs:
        with pytest.raises(error, match=match):
            cache.unpin(tokens, namespace)
    assert cache.stats()["pins"] == 0
    assert cache.tree.match_prefix(A).last_device_node.lock_ref == 0
    assert_no_leaks(cache)


def test_bad_max_pinned_fraction():
    for bad, error in ((1.5, ValueError), (-0.1, ValueError), ("0.5", TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_pinned_fraction"):
            CacheConfig(KV_TINY, device_tokens=8, max_pinned_fraction=bad)


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_integrity_catches_a_lost_pin_lock(tree):
    cache = bookkeeping(tree)
    serve(cache, A)
    cache.pin(A)
    node = cache.tree.match_prefix(A).last_device_node
    cache.tree.unlock(node)  # behind the cache's back: the pin's lock is gone
    with pytest.raises(AssertionError, match="lock"):
        cache.check_integrity()


# ------------------------------------------------------------ namespaces (issue 46)
@pytest.mark.parametrize(("tree", "lifecycle"), CONFIGS)
def test_the_state_of_a_namespace_is_freed_once_it_holds_nothing(tree, lifecycle):
    """Each distinct namespace gets a root; once a namespace holds no page and no live
    request locks its root, the root (and its name) is freed: by a reset, by eviction,
    and when a request that matched nothing is released. check_integrity asserts it."""
    cache = bookkeeping(tree, lifecycle, device_tokens=256, host_tokens=512)
    for i in range(40):
        serve(cache, A, f"tenant-{i}")
    cache.check_integrity()
    assert cache.tree.namespaces() == [f"tenant-{i}" for i in range(40)]
    held = cache.match(B, "held")  # matched nothing: locks its namespace's root
    assert cache.pin(A, "never-cached") == 0  # a pin of nothing makes no namespace
    assert cache.tree.namespaces()[-1] == "held"
    r = cache.reset()
    assert r.complete and cache.tree.num_nodes == 0
    assert cache.tree.namespaces() == ["held"]
    cache.check_integrity()
    cache.release(held)
    assert cache.tree.namespaces() == []
    assert_no_leaks(cache)
    cache.close()
    # eviction alone frees them too: 8 namespaces of 2 pages fill both tiers (16 pages
    # each); a 16-page request evicts them from the device, its backup from the host
    cache = bookkeeping(tree, lifecycle, device_tokens=32, host_tokens=32)
    for i in range(8):
        serve(cache, [i + 1] * 4, f"t{i}")
    assert len(cache.tree.namespaces()) == 8
    serve(cache, list(range(32)))
    assert cache.tree.namespaces() == [None]
    assert cache.tree.host_tokens == 32 and cache.tree.num_nodes == 1
    assert_no_leaks(cache)

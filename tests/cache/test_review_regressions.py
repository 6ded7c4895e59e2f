"""Regressions for bugs a review of the cache found (each failed before its fix)."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from kv_layouts import KV, TREE_KINDS
from serving import serve as serve_request

from hicache.cache import HiCache
from hicache.config import CacheConfig

# A full hit only matches (no alloc, no insert): repeating a request repeats its match alone.
serve = partial(serve_request, skip_cached=True)


def complete_transfers(cache: HiCache) -> None:
    if cache.transfers.executor_name == "manual":
        for t in cache.transfers.executor.pending():
            cache.transfers.executor.complete(t)
    cache.poll()
    for job in set(cache._inflight.storage_pins.values()):
        job.done.wait()
    cache.poll()


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
        serve(cache, a)  # the third serve reaches the threshold: A's backup in flight
    node_a = cache.tree.match_prefix(a).last_node
    rec_a = cache._inflight.by_node[node_a]
    for _ in range(3):
        serve(cache, ab)  # B (child of A) is backed up; A is still in flight
    (node_b,) = node_a.children.values()
    ex.complete(cache._inflight.by_node[node_b].handle)
    ex.fail(rec_a.handle, RuntimeError("injected backup failure"))
    cache.poll()
    assert node_a.on_host and cache._inflight.by_node[node_a] is not rec_a  # retried
    assert cache.stats()["backups_retried"] == 1
    cache.check_integrity()
    for _ in range(3):
        serve(cache, [50, 51])
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


@pytest.mark.parametrize("executor", ["manual", "immediate"])
def test_storage_read_landing_during_load_setup_does_not_split_pinned_nodes(tmp_path, executor):
    cfg = dict(device_tokens=8, host_tokens=32, tree="python", storage=f"file:{tmp_path}",
               model_id="test-model")
    first = HiCache(CacheConfig(KV, executor="immediate", **cfg))
    serve(first, [1, 2])
    first.close()

    cache = HiCache(CacheConfig(KV, executor=executor, write_policy="write_back", **cfg))
    go = threading.Event()
    backend = cache.storage.backend
    get_into = backend.get_into

    def slow_get(keys, views):
        go.wait()
        return get_into(keys, views)

    backend.get_into = slow_get
    job = cache.prefetch([1, 2])  # nothing cached yet: the read of [1, 2] is held back
    serve(cache, [1, 2, 3, 4])
    hx = cache.match([100, 101])
    cache.alloc(hx, 8)  # write-back eviction of [1, 2, 3, 4] to the host
    complete_transfers(cache)
    cache.release(hx)
    complete_transfers(cache)
    serve(cache, [20, 21, 22, 23, 24, 25, 26, 27])
    complete_transfers(cache)
    backup = cache.transfers.backup

    def backup_after_the_read(*args, **kwargs):  # the read lands while the load evicts
        go.set()
        job.done.wait()
        return backup(*args, **kwargs)

    cache.transfers.backup = backup_after_the_read
    h = cache.match([1, 2, 3, 4])
    assert h.host_len == 4
    cache.release(h)
    complete_transfers(cache)
    cache.check_integrity()
    cache.close()


def test_storage_worker_survives_an_unexpected_backend_exception(tmp_path):
    cfg = dict(device_tokens=8, host_tokens=32, tree="python", storage=f"file:{tmp_path}",
               model_id="test-model")
    first = HiCache(CacheConfig(KV, executor="immediate", **cfg))
    serve(first, [1, 2])
    first.close()
    cache = HiCache(CacheConfig(KV, executor="immediate", **cfg))

    def broken(keys, views):
        raise RuntimeError("transport error")

    cache.storage.backend.get_into = broken
    job = cache.prefetch([1, 2])
    assert job.done.wait(5), "the failed read never finished"
    cache.poll()
    s = cache.stats()
    assert s["storage_errors"] == 1 and s["host_pages_used"] == 0
    assert all(t.is_alive() for t in cache.storage._threads)
    cache.check_integrity()
    cache.close()

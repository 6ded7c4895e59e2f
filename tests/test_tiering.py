"""Third tier through HiCache: background writes, prefetch policies, integrity, failures."""

from __future__ import annotations

import pytest
import torch
from test_cache import KV, assert_quiescent, compute, read_prefix, serve

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.tree import token_key

A = [1, 1, 2, 2, 3, 3, 4, 4]


def make(tmp_path, **kw) -> HiCache:
    cfg = dict(device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}", executor="thread")
    cfg.update(kw)
    return HiCache(CacheConfig(KV, **cfg))


def test_second_cache_gets_storage_hits_for_a_prefix_only_the_first_saw(tmp_path):
    first = make(tmp_path)
    serve(first, A)
    first.wait_all()
    s = first.stats()
    assert s["storage_writes"] == 1 and s["storage_write_bytes"] == 4 * KV.page_nbytes
    assert_quiescent(first)
    first.close()

    second = make(tmp_path, prefetch_policy="wait_complete")
    h = second.match(A + [5, 5])
    assert (h.device_len, h.host_len, h.prefix_len) == (0, 8, 8)
    read_prefix(second, h, A)  # bitwise what the first cache computed
    second.release(h)
    s = second.stats()
    assert s["storage_prefetches"] == 1 and s["storage_hit_tokens"] == 8
    assert s["storage_read_bytes"] == 4 * KV.page_nbytes
    assert s["host_hit_tokens"] == 8
    assert_quiescent(second)
    second.close()


def test_best_effort_uses_prefetch_started_at_arrival(tmp_path):
    first = make(tmp_path)
    serve(first, A)
    first.close()
    second = make(tmp_path, prefetch_policy="best_effort")
    job = second.prefetch(A)
    assert job is not None
    job.done.wait()
    h = second.match(A)  # scheduled after the pages arrived: they are used
    assert h.prefix_len == 8
    read_prefix(second, h, A)
    second.release(h)
    assert_quiescent(second)
    second.close()


def test_timeout_policy_without_storage_pages_computes_everything(tmp_path):
    cache = make(tmp_path, prefetch_policy="timeout", prefetch_timeout_s=0.01)
    h = cache.match(A)
    assert h.prefix_len == 0
    assert cache.stats()["storage_prefetches"] == 0
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_corrupt_storage_value_is_a_miss_not_garbage(tmp_path):
    first = make(tmp_path)
    serve(first, A)
    first.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 4
    for f in files:  # flip a byte in every value's payload
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    second = make(tmp_path, prefetch_policy="wait_complete")
    h = second.match(A)
    assert h.prefix_len == 0  # nothing usable: computed, never garbage
    compute(second, h, A)
    second.insert(h, A)
    second.release(h)
    assert second.storage.backend.counters().num_corrupt_values >= 1
    assert_quiescent(second)
    second.close()


def test_namespaces_are_isolated_in_storage(tmp_path):
    first = make(tmp_path)
    serve(first, A, namespace="a")
    first.close()
    second = make(tmp_path, prefetch_policy="wait_complete")
    h = second.match(A, namespace="b")
    assert h.prefix_len == 0
    second.release(h)
    h = second.match(A, namespace="a")
    assert h.prefix_len == 8
    second.release(h)
    assert_quiescent(second)
    second.close()


def test_store_going_away_keeps_serving_and_counts_errors(tmp_path):
    cache = make(tmp_path / "store")
    serve(cache, A)
    cache.wait_all()
    cache.storage.backend.close()  # the store is gone: every later op raises StorageError
    serve(cache, [9, 9, 8, 8])
    cache.wait_all()
    h = cache.match(A)
    assert h.device_len + h.host_len == 8  # device and host tiers still serve
    read_prefix(cache, h, A)
    cache.release(h)
    assert cache.stats()["storage_errors"] >= 1
    assert_quiescent(cache)
    cache.transfers.close()


def test_storage_needs_a_host_tier(tmp_path):
    with pytest.raises(ValueError, match="host tier"):
        HiCache(CacheConfig(KV, device_tokens=8, storage=f"file:{tmp_path}"))
    with pytest.raises(ValueError, match="storage spec"):
        HiCache(CacheConfig(KV, device_tokens=8, host_tokens=8, storage="ftp://x"))


def test_split_while_storage_write_pinned(tmp_path):
    cache = make(tmp_path, device_tokens=16, host_tokens=32)
    serve(cache, A)
    # backup done, storage write may be in flight: a match splitting the node must keep pins
    h = cache.match([1, 1, 2, 2, 7, 7])
    cache.release(h)
    cache.wait_all()
    assert_quiescent(cache)
    assert torch.equal(torch.tensor(0), torch.tensor(cache.tree.host_protected_tokens))
    cache.close()


@pytest.mark.parametrize(
    "tokens, namespace, exc",
    [("12", None, TypeError), ([1, -2], None, ValueError), ([1.5, 2], None, TypeError),
     ([1, 2], 3, TypeError)],
)
def test_prefetch_bad_input_raises_and_changes_nothing(tmp_path, tokens, namespace, exc):
    cache = make(tmp_path)
    serve(cache, A)
    cache.wait_all()
    before = cache.stats()
    with pytest.raises(exc):
        cache.prefetch(tokens, namespace)
    assert cache.stats() == before
    assert_quiescent(cache)
    cache.close()


def test_prefetch_counts_no_hit_on_the_cached_prefix(tmp_path):
    """Only a match is a hit: a prefetch that extends a cached prefix reads the tree only."""
    first = make(tmp_path, device_tokens=16, host_tokens=32)
    serve(first, A + [5, 5])
    first.close()
    second = make(tmp_path, device_tokens=16, host_tokens=32, prefetch_policy="best_effort")
    serve(second, A)
    (node,) = second.tree.probe_path(token_key(A, KV.page_size))
    hits, access = node.hit_count, node.last_access
    job = second.prefetch(A + [5, 5])
    assert job is not None and job.start_page == len(A) // KV.page_size
    assert (node.hit_count, node.last_access) == (hits, access)
    job.done.wait()
    second.wait_all()
    h = second.match(A + [5, 5])
    assert h.prefix_len == len(A) + 2  # the prefetched page is used
    second.release(h)
    assert_quiescent(second)
    second.close()

"""Third tier through HiCache: background writes, prefetch policies, integrity, failures."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch
from kv_layouts import KV
from leak_checks import assert_quiescent, complete_transfers
from serving import compute, read_prefix, serve, serve_kv

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.storage import model_identity
from hicache.tree import token_key

A = [1, 1, 2, 2, 3, 3, 4, 4]


def make(tmp_path, **kw) -> HiCache:
    cfg = dict(device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}", executor="thread",
               model_id="test-model")
    cfg.update(kw)
    return HiCache(CacheConfig(KV, **cfg))


def test_second_cache_gets_storage_hits_for_a_prefix_only_the_first_saw(tmp_path):
    first = make(tmp_path)
    serve_kv(first, A)
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
    serve_kv(first, A)
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
    serve_kv(first, A)
    first.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path)
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
    serve_kv(first, A, namespace="a")
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
    serve_kv(cache, A)
    cache.wait_all()
    cache.storage.backend.close()  # the store is gone: every later op raises StorageError
    serve_kv(cache, [9, 9, 8, 8])
    cache.wait_all()
    h = cache.match(A)
    assert h.device_len + h.host_len == 8  # device and host tiers still serve
    read_prefix(cache, h, A)
    cache.release(h)
    assert cache.stats()["storage_errors"] >= 1
    assert_quiescent(cache)
    cache.transfers.close()


def test_models_sharing_a_store_never_read_each_others_pages(tmp_path):
    """Equal keys mean equal KV: the model identity is in every key, so a cache of another
    model with the same KV layout (another revision here) gets no page of this one."""
    r1, r2 = model_identity("m", revision="1"), model_identity("m", revision="2")
    with make(tmp_path, model_id=r1) as first:
        serve_kv(first, A)
    other = make(tmp_path, model_id=r2, prefetch_policy="wait_complete")
    assert other.prefetch(A) is None  # nothing stored for this model
    h = other.match(A)
    assert h.prefix_len == 0  # before: 8, the other model's KV
    other.release(h)
    serve_kv(other, A)  # computes and stores its own pages next to the first model's
    other.wait_all()
    s = other.stats()
    assert (s["storage_prefetches"], s["storage_hit_tokens"]) == (0, 0)
    assert s["storage_write_bytes"] == 4 * KV.page_nbytes  # not "already stored"
    assert_quiescent(other)
    other.close()
    same = make(tmp_path, model_id=r1, prefetch_policy="wait_complete")
    h = same.match(A)
    assert h.prefix_len == 8  # the same model still gets its pages
    read_prefix(same, h, A)
    same.release(h)
    assert_quiescent(same)
    same.close()


@pytest.mark.parametrize(
    ("model_id", "error", "match"),
    [(None, ValueError, "expected a model_id"), ("", ValueError, "non-empty"),
     (" ", ValueError, "non-empty"), (7, TypeError, "model_id: expected"),
     (b"m", TypeError, "model_id: expected")],
)
def test_storage_without_a_model_identity_is_refused(tmp_path, model_id, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(KV, device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}",
                    model_id=model_id)
    assert not any(tmp_path.iterdir())  # refused before anything was opened
    if model_id is not None:  # a bad identity is refused without storage too
        with pytest.raises(error, match=match):
            CacheConfig(KV, device_tokens=8, host_tokens=16, model_id=model_id)


def store_prompts(tmp_path, *prompts: list[int]) -> None:
    """A first cache (room for everything: no backup skipped) computes and stores them."""
    with make(tmp_path, device_tokens=32, host_tokens=64) as first:
        for tokens in prompts:
            serve_kv(first, tokens)


def hold_reads(cache: HiCache) -> threading.Event:
    """Storage reads wait for the returned event: prefetches stay in flight meanwhile."""
    gate = threading.Event()
    backend = cache.storage.backend
    get_into = backend.get_into

    def gated(keys, views):
        gate.wait(10)
        return get_into(keys, views)

    backend.get_into = gated
    return gate


def test_prefetches_of_two_prompts_with_nothing_cached_both_fetch(tmp_path):
    """Both start at page 0 of one namespace; before, the second was taken for the first
    ("already on its way") and its storage hits were lost."""
    b = [9, 9, 8, 8, 7, 7, 6, 6]
    store_prompts(tmp_path, A, b)
    cache = make(tmp_path, host_tokens=32, prefetch_policy="best_effort")
    gate = hold_reads(cache)
    job_a, job_b = cache.prefetch(A), cache.prefetch(b)
    assert job_a is not None and job_b is not None and job_b is not job_a
    assert (job_b.start_page, len(job_b.keys)) == (0, 4)
    gate.set()
    cache.wait_all()
    for tokens in (A, b):
        h = cache.match(tokens)
        assert (h.device_len, h.host_len) == (0, 8)
        read_prefix(cache, h, tokens)
        cache.release(h)
    s = cache.stats()
    assert (s["storage_prefetches"], s["storage_hit_tokens"]) == (2, 16)
    assert s["storage_read_bytes"] == 8 * KV.page_nbytes
    assert_quiescent(cache)
    cache.close()


def test_prefetch_joins_or_continues_reads_in_flight_by_their_tokens(tmp_path):
    c = A[:4] + [6, 6, 5, 5]  # shares A's pages 0-1
    d = A[:2] + [7, 7, 5, 5, 6, 6]  # shares A's page 0 only
    store_prompts(tmp_path, A, c, d)
    cache = make(tmp_path, host_tokens=32, prefetch_policy="best_effort")
    gate = hold_reads(cache)
    first = cache.prefetch(A[:4])
    assert (first.start_page, len(first.keys)) == (0, 2)
    assert cache.prefetch(A[:4]) is first  # the same pages: already on their way
    assert cache.prefetch(A[:2]) is first  # a prefix of them too
    rest_a = cache.prefetch(A)  # goes further: continues after the read in flight
    assert (rest_a.start_page, len(rest_a.keys)) == (2, 2)
    assert cache.prefetch(A) is rest_a
    rest_c = cache.prefetch(c)  # same pages 0-1, its own pages 2-3
    assert (rest_c.start_page, len(rest_c.keys)) == (2, 2)
    whole_d = cache.prefetch(d)  # differs inside the first read: a read of its own
    assert (whole_d.start_page, len(whole_d.keys)) == (0, 4)
    assert len({id(j) for j in (first, rest_a, rest_c, whole_d)}) == 4
    cache.check_integrity()
    gate.set()
    cache.wait_all()
    for tokens, device_len in ((A, 0), (c, 4), (d, 2)):  # shared pages loaded before
        h = cache.match(tokens)
        assert (h.device_len, h.host_len) == (device_len, 8 - device_len)
        read_prefix(cache, h, tokens)
        cache.release(h)
    s = cache.stats()
    assert s["storage_prefetches"] == 4
    assert s["storage_read_bytes"] == 10 * KV.page_nbytes
    # d's page 0 arrived twice: the tree kept the first copy and the second was freed.
    assert s["storage_hit_tokens"] == 2 * (4 + 2 + 3)
    assert_quiescent(cache)
    cache.close()


def test_storage_needs_a_host_tier(tmp_path):
    with pytest.raises(ValueError, match="host tier"):
        HiCache(CacheConfig(KV, device_tokens=8, storage=f"file:{tmp_path}", model_id="m"))
    with pytest.raises(ValueError, match="storage spec"):
        HiCache(CacheConfig(KV, device_tokens=8, host_tokens=8, storage="ftp://x",
                            model_id="m"))


def test_split_while_storage_write_pinned(tmp_path):
    cache = make(tmp_path, device_tokens=16, host_tokens=32)
    serve_kv(cache, A)
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
    serve_kv(cache, A)
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
    serve_kv(first, A + [5, 5])
    first.close()
    second = make(tmp_path, device_tokens=16, host_tokens=32, prefetch_policy="best_effort")
    serve_kv(second, A)
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


# A full hit only matches (no alloc, no insert): repeating a request repeats its match alone.
serve_skipping_hits = partial(serve, skip_cached=True)


@pytest.mark.parametrize("executor", ["manual", "immediate"])
def test_storage_read_landing_during_load_setup_does_not_split_pinned_nodes(tmp_path, executor):
    cfg = dict(device_tokens=8, host_tokens=32, tree="python", storage=f"file:{tmp_path}",
               model_id="test-model")
    first = HiCache(CacheConfig(KV, executor="immediate", **cfg))
    serve_skipping_hits(first, [1, 2])
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
    serve_skipping_hits(cache, [1, 2, 3, 4])
    hx = cache.match([100, 101])
    cache.alloc(hx, 8)  # write-back eviction of [1, 2, 3, 4] to the host
    complete_transfers(cache)
    cache.release(hx)
    complete_transfers(cache)
    serve_skipping_hits(cache, [20, 21, 22, 23, 24, 25, 26, 27])
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

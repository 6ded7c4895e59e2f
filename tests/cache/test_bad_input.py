"""Bad input on every public entry point: a clear TypeError/ValueError, the cache unchanged.

"Unchanged" is checked, not assumed: ``stats()``, the whole tree (every node's
key, page ids, locks, IO status), both allocators, the transfers in flight and
the live handles are snapshotted before the call and compared after it, and
``check_integrity()`` passes. The cache under test is mid-flight: a load and a
backup pending, a live handle owning pages, a host-only node. Each case is
listed in docs/reliability.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_layouts import LIFECYCLES, P, kv_one_float, seq
from leak_checks import assert_no_leaks
from manual_executor import KV_F16, host_only, make_cache, serve_manual
from optional import skip_unless
from serving import bookkeeping

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.sim import kvcheck

FOREIGN = make_cache()  # another cache: its handles are foreign to the one under test


def busy_cache():
    """A cache with IO in flight and live handles; returns (cache, handles)."""
    cache = make_cache(device_pages=12, host_pages=16)
    host_only(cache, seq(100, 2))
    serve_manual(cache, seq(300, 2))  # its write-through backup stays pending
    loading = cache.match(seq(100, 2) + seq(7, 1))  # load of the host-only node pending
    owner = cache.match(seq(500, 2))
    assert cache.alloc(owner, 3 * P) is not None
    hit = cache.match(seq(300, 2) + seq(9, 1))  # a 2-page device hit
    assert hit.prefix_len == 2 * P
    released = cache.match(seq(600, 1))
    cache.release(released)
    assert cache.stats()["transfers_in_flight"] == 2
    return cache, {"loading": loading, "owner": owner, "hit": hit, "released": released}


def snapshot(cache: HiCache, handles: dict) -> tuple:
    tree = tuple(
        (
            n.id, n.key, n.namespace, n.lock_ref, n.host_lock_ref, n.io_status, n.hit_count,
            n.last_access, None if n.device_indices is None else tuple(n.device_indices.tolist()),
            None if n.host_indices is None else tuple(n.host_indices.tolist()),
        )
        for n in cache.tree.nodes()
    )
    hs = tuple(
        (name, h.prefix_len, h.device_len, h.host_len, h.num_owned_pages, h.released, h.key)
        for name, h in sorted(handles.items())
    )
    allocs = tuple(
        (a.num_free_pages, tuple(np.flatnonzero(a._in_use).tolist()))
        for a in (cache.device_allocator, cache.host_allocator)
    )
    pending = tuple((t.kind, t.layers_done) for t in cache.transfers.executor.pending())
    return cache.stats(), tree, hs, allocs, pending




# (id, callable(cache, handles), expected exception, message fragment)
CASES = [
    # match: tokens
    ("match-none", lambda c, h: c.match(None), TypeError, "tokens"),
    ("match-str", lambda c, h: c.match("1 2 3 4"), TypeError, "tokens"),
    ("match-dict", lambda c, h: c.match({1: 2}), TypeError, "tokens"),
    ("match-float-list", lambda c, h: c.match([1.5, 2.0, 3.0, 4.0]), TypeError, "integer"),
    ("match-str-list", lambda c, h: c.match(["a", "b"]), TypeError, "integer"),
    ("match-negative-token", lambda c, h: c.match([1, -2, 3, 4]), ValueError, ">= 0"),
    ("match-token-too-big", lambda c, h: c.match([1, 2**31, 3, 4]), ValueError, "2147483647"),
    ("match-np-float", lambda c, h: c.match(np.ones(4)), TypeError, "dtype"),
    ("match-np-2d", lambda c, h: c.match(np.ones((2, 2), dtype=np.int32)), ValueError, "1-D"),
    ("match-np-negative", lambda c, h: c.match(np.array([1, -1, 2, 3])), ValueError, "range"),
    ("match-np-int32-negative", lambda c, h: c.match(np.array([1, -1, 2, 3], dtype=np.int32)),
     ValueError, "ids in"),
    ("match-torch-float", lambda c, h: c.match(torch.ones(4)), TypeError, "dtype"),
    ("match-torch-bf16", lambda c, h: c.match(torch.ones(4, dtype=torch.bfloat16)), TypeError,
     "dtype"),
    ("match-torch-2d", lambda c, h: c.match(torch.ones(2, 2, dtype=torch.int64)), ValueError,
     "1-D"),
    ("match-torch-meta", lambda c, h: c.match(torch.ones(4, dtype=torch.int64, device="meta")),
     ValueError, "meta"),
    # match: namespace, flags
    ("match-ns-int", lambda c, h: c.match([1, 2], 5), TypeError, "namespace"),
    ("match-ns-bytes", lambda c, h: c.match([1, 2], b"t"), TypeError, "namespace"),
    ("match-ns-list", lambda c, h: c.match([1, 2], ["t"]), TypeError, "namespace"),
    ("match-load-back-str", lambda c, h: c.match([1, 2], load_back="no"), TypeError,
     "load_back"),
    # handles: wrong types, foreign, released
    ("alloc-none-handle", lambda c, h: c.alloc(None, 2), TypeError, "PrefixHandle"),
    ("alloc-int-handle", lambda c, h: c.alloc(3, 2), TypeError, "PrefixHandle"),
    ("alloc-foreign", lambda c, h: c.alloc(FOREIGN.match([1, 2]), 2), ValueError, "another"),
    ("alloc-released", lambda c, h: c.alloc(h["released"], 2), ValueError, "released"),
    ("release-twice", lambda c, h: c.release(h["released"]), ValueError, "released"),
    ("release-none", lambda c, h: c.release(None), TypeError, "PrefixHandle"),
    ("release-foreign", lambda c, h: c.release(FOREIGN.match([1, 2])), ValueError, "another"),
    ("insert-released", lambda c, h: c.insert(h["released"], seq(600, 1)), ValueError,
     "released"),
    ("insert-foreign", lambda c, h: c.insert(FOREIGN.match([1, 2]), [1, 2]), ValueError,
     "another"),
    ("load-back-released", lambda c, h: c.load_back(h["released"]), ValueError, "released"),
    ("load-back-str", lambda c, h: c.load_back("h"), TypeError, "PrefixHandle"),
    ("finish-loads-released", lambda c, h: c.finish_loads(h["released"]), ValueError,
     "released"),
    ("finish-loads-foreign", lambda c, h: c.finish_loads(FOREIGN.match([1])), ValueError,
     "another"),
    # alloc: counts
    ("alloc-negative", lambda c, h: c.alloc(h["owner"], -1), ValueError, ">= 0"),
    ("alloc-float", lambda c, h: c.alloc(h["owner"], 2.0), TypeError, "int"),
    ("alloc-bool", lambda c, h: c.alloc(h["owner"], True), TypeError, "int"),
    ("alloc-str", lambda c, h: c.alloc(h["owner"], "4"), TypeError, "int"),
    ("alloc-none", lambda c, h: c.alloc(h["owner"], None), TypeError, "int"),
    # insert: tokens that do not fit the handle
    ("insert-not-extending", lambda c, h: c.insert(h["loading"], seq(101, 3)), ValueError,
     "in flight"),
    ("insert-diverging", lambda c, h: c.insert(h["hit"], seq(301, 3)), ValueError, "prefix"),
    ("insert-shorter-than-prefix", lambda c, h: c.insert(h["hit"], seq(300, 1)), ValueError,
     "prefix"),
    ("insert-more-than-owned", lambda c, h: c.insert(h["owner"], seq(500, 6)), ValueError,
     "pages"),
    ("insert-float-tokens", lambda c, h: c.insert(h["owner"], np.ones(4)), TypeError, "dtype"),
    ("insert-generator", lambda c, h: c.insert(h["owner"], (t for t in range(4))), TypeError,
     "tokens"),
    ("insert-negative-token", lambda c, h: c.insert(h["owner"], [-1, 0, 1, 2]), ValueError,
     ">= 0"),
    # the handle itself
    ("wait-layer-negative", lambda c, h: h["owner"].wait_layer(-1), ValueError, "layer"),
    ("wait-layer-too-big", lambda c, h: h["loading"].wait_layer(KV_F16.num_layers), ValueError,
     "layer"),
    ("wait-layer-str", lambda c, h: h["owner"].wait_layer("0"), TypeError, "layer"),
    ("page-table-released", lambda c, h: h["released"].page_table(), ValueError, "released"),
    ("prefix-pages-released", lambda c, h: h["released"].prefix_pages, ValueError, "released"),
    ("wait-all-negative", lambda c, h: c.wait_all(-1), ValueError, "timeout"),
    ("wait-all-str", lambda c, h: c.wait_all("1"), TypeError, "timeout"),
    # transfer engine and pools reached through the cache: page ids, dtypes, devices
    ("load-float-pages", lambda c, h: c.transfers.load(torch.zeros(1), torch.zeros(1)),
     TypeError, "int64"),
    ("load-out-of-range", lambda c, h: c.transfers.load(
        torch.tensor([10**6]), torch.tensor([0])), ValueError, "ids in"),
    ("load-negative-page", lambda c, h: c.transfers.load(
        torch.tensor([0]), torch.tensor([-1])), ValueError, "ids in"),
    ("load-length-mismatch", lambda c, h: c.transfers.load(
        torch.tensor([0, 1]), torch.tensor([0])), ValueError, "lengths"),
    ("load-meta-pages", lambda c, h: c.transfers.load(
        torch.zeros(1, dtype=torch.int64, device="meta"), torch.tensor([0])), ValueError,
     "CPU"),
    ("load-2d-pages", lambda c, h: c.transfers.load(
        torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)),
     ValueError, "1-D"),
    ("backup-bad-fence", lambda c, h: c.transfers.backup(
        torch.tensor([0]), torch.tensor([0]), after="now"), TypeError, "fence"),
    ("write-pages-wrong-dtype", lambda c, h: c.device_pool.write_pages(
        0, torch.tensor([0]), torch.zeros(P, KV_F16.num_kv_heads, KV_F16.head_dim),
        torch.zeros(P, KV_F16.num_kv_heads, KV_F16.head_dim)), TypeError, "dtype"),
    ("write-pages-wrong-shape", lambda c, h: c.device_pool.write_pages(
        0, torch.tensor([0]), torch.zeros(1, dtype=torch.float16),
        torch.zeros(1, dtype=torch.float16)), ValueError, "shape"),
    ("write-pages-bad-layer", lambda c, h: c.device_pool.write_pages(
        KV_F16.num_layers, torch.tensor([0]), torch.zeros(1), torch.zeros(1)), ValueError, "layer"),
    ("free-foreign-page", lambda c, h: c.device_allocator.free(torch.tensor([10**6])),
     ValueError, "[0,"),
    ("free-unallocated-page", lambda c, h: c.host_allocator.free(
        torch.tensor([c.host_allocator.num_pages - 1])), ValueError, "double free"),
    ("free-int32-pages", lambda c, h: c.device_allocator.free(
        torch.tensor([0], dtype=torch.int32)), TypeError, "int64"),
    # kvcheck (the verification helper itself)
    ("kvcheck-page-out-of-range", lambda c, h: kvcheck.write_kv(
        c.device_pool, torch.tensor([10**6]), [1, 2], 0, 2), ValueError, "page_table"),
    ("kvcheck-short-table", lambda c, h: kvcheck.verify_kv(
        c.device_pool, torch.tensor([0]), seq(0, 2), 2 * P), ValueError, "pages"),
    ("kvcheck-int32-table", lambda c, h: kvcheck.write_kv(
        c.device_pool, torch.tensor([0], dtype=torch.int32), [1, 2], 0, 2), TypeError,
     "int64"),
    ("kvcheck-end-past-tokens", lambda c, h: kvcheck.verify_kv(
        c.device_pool, torch.tensor([0, 1]), [1, 2], 4), ValueError, "end"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(case):
    _, call, exc, fragment = case
    cache, handles = busy_cache()
    before = snapshot(cache, handles)
    with pytest.raises(exc) as info:
        call(cache, handles)
    assert fragment in str(info.value), f"unclear message: {info.value}"
    assert snapshot(cache, handles) == before, "a rejected call changed the cache"
    cache.check_integrity()


@pytest.mark.parametrize(
    "config",
    [None, "cfg", KV_F16],
    ids=["none", "str", "kvconfig"],
)
def test_hicache_rejects_a_non_config(config):
    with pytest.raises(TypeError, match="CacheConfig"):
        HiCache(config)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(device_tokens=-4), ValueError),
        (dict(device_tokens=1.5), TypeError),
        (dict(device_tokens=P, host_tokens=0), ValueError),
        (dict(device_tokens=P, write_policy="write_sometimes"), ValueError),
        (dict(device_tokens=P, executor="gpu-please"), ValueError),
        (dict(device_tokens=P, load_threshold_tokens=-1), ValueError),
        (dict(device_tokens=P, device="tpu"), ValueError),
    ],
)
def test_cache_config_rejects_bad_values(kwargs, exc):
    with pytest.raises(exc):
        CacheConfig(KV_F16, **kwargs)


@pytest.mark.parametrize("lifecycle", ["python", pytest.param("native", marks=skip_unless("native"))])
def test_alloc_takes_a_numpy_integer_like_every_count(lifecycle):
    """Counts are checked by hicache.checks.check_int everywhere: numpy integers are ints."""
    if lifecycle == "native":
        cache = HiCache(CacheConfig(
            kv=KV_F16, device_tokens=8 * P, host_tokens=8 * P, allocate_kv=False, tree="native",
            lifecycle="native",
        ))
    else:
        cache = make_cache(device_pages=8, host_pages=8)
    h = cache.match(seq(1, 1))
    pages = cache.alloc(h, np.int64(2 * P))
    assert pages is not None and pages.shape[0] == 2 and h.num_owned_pages == 2
    cache.release(h)
    cache.check_integrity()


def test_a_rejected_call_leaves_the_cache_fully_usable():
    cache, handles = busy_cache()
    for _, call, exc, _ in CASES:
        with pytest.raises(exc):
            call(cache, handles)
    for t in cache.transfers.executor.pending():
        cache.transfers.executor.complete(t)
    for name in ("loading", "owner", "hit"):
        cache.release(handles[name])
    serve_manual(cache, seq(100, 2) + seq(7, 1))
    cache.check_integrity()
    assert kvcheck.verify_cache(cache) == []


@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES)
@pytest.mark.parametrize("bad", [
    [1, 2, -1], [1, 2, 2**40], [1, 2, "x"], [1, 2, None], [1, 2, 1.5],
    "np64", "np32", "torch64", "torch32", "np_big",
])
def test_token_ids_in_the_trailing_partial_page_are_validated(tree, lifecycle, bad):
    made = {
        "np64": np.array([1, 2, -1]), "np32": np.array([1, 2, -1], dtype=np.int32),
        "torch64": torch.tensor([1, 2, -1]), "torch32": torch.tensor([1, 2, -1], dtype=torch.int32),
        "np_big": np.array([1, 2, 2**40]),
    }
    tokens = made.get(bad, bad) if isinstance(bad, str) else bad
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(2), device_tokens=16, host_tokens=None)
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

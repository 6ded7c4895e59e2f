"""The tree's memory: the index tensors behind its nodes hold at most twice the page ids
it caches (a leaf used to keep a view of its request's whole page table alive), through
splits, evictions and loads.
"""

from __future__ import annotations

import pytest
from kv_layouts import LIFECYCLES, P, kv_one_float, seq
from leak_checks import assert_no_leaks
from manual_executor import (
    complete,
    make_cache,
    serve_manual,
)
from serving import bookkeeping, serve


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
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(1), device_tokens=5000, host_tokens=5000)
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

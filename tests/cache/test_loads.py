"""Loads from the host tier, request by request: ``load_back`` before and after an
allocation, a failed load applied only by the request it belongs to, and the load error
it leaves until a retry succeeds.

Each test failed before its fix. KV runs on the manual executor and is verified byte
for byte.
"""

from __future__ import annotations

import pytest
from kv_layouts import P, seq
from leak_checks import assert_no_leaks
from manual_executor import (
    complete,
    host_only,
    make_cache,
    pending,
    serve_manual,
    verify_prefix,
)

from hicache.cache import LoadError
from hicache.sim import kvcheck
from hicache.transfer import TransferKind


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

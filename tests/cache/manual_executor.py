"""Scenarios on the manual executor, where a copy runs only when a test says so, with
the KV of :mod:`hicache.sim.kvcheck` written and verified (tests/cache only).

:func:`serve_manual` is one whole request: this request's loads completed here, KV
written and verified, integrity checked. :func:`settle` drives a cache to quiescence
and checks everything.
"""

from __future__ import annotations

from kv_layouts import P
from leak_checks import assert_no_leaks

from hicache.cache import HiCache
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck
from hicache.transfer import TransferKind

# float16, 2 heads: the layout of the manual-executor scenarios (kvcheck's patterns).
KV_F16 = KVConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=P)


def make_cache(device_pages: int = 8, host_pages: int = 16, policy: str = "write_through",
               executor: str = "manual", **kw) -> HiCache:
    """A :data:`KV_F16` cache on the manual executor: a copy runs only when a test says so.

    (``executor``: another one, for the race scenarios run on real threads or streams.)"""
    cfg = CacheConfig(
        KV_F16, device_tokens=device_pages * P, host_tokens=host_pages * P, executor=executor,
        host_reserve_nbytes=0, write_policy=policy, **kw,
    )
    return HiCache(cfg)


def pending(cache: HiCache, kind: TransferKind | None = None):
    return [t for t in cache.transfers.executor.pending() if kind is None or t.kind is kind]


def complete(cache: HiCache, kind: TransferKind | None = None) -> None:
    """Finish every pending transfer of ``kind`` (all kinds: None), then apply them."""
    for t in pending(cache, kind):
        assert cache.transfers.executor.complete(t), f"{t} is waiting on a fence"
    cache.poll()


def verify_prefix(cache: HiCache, h, tokens, ns=None) -> None:
    assert kvcheck.verify_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, ns) == []


def serve_manual(cache: HiCache, tokens, ns=None, *, complete_loads: bool = True):
    """One whole request: match, load (completed here), verify, compute the rest, insert."""
    before = pending(cache, TransferKind.LOAD)
    h = cache.match(tokens, ns)
    if complete_loads:  # only the loads this match started
        for load in pending(cache, TransferKind.LOAD):
            if load not in before:
                cache.transfers.executor.complete(load)
    assert cache.finish_loads(h), h.load_error
    verify_prefix(cache, h, tokens, ns)
    rest = len(tokens) - h.prefix_len
    assert cache.alloc(h, rest) is not None
    kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, len(tokens), ns)
    cache.insert(h, tokens)
    verify_prefix(cache, h, tokens, ns)
    cache.release(h)
    cache.check_integrity()


def evict_all_device(cache: HiCache) -> None:
    """Push every unlocked node off the device through the public API.

    Backups in flight (write-through, or write-back evictions) are completed first
    when they hold pages back.
    """
    for _ in range(2):
        h = cache.match([])
        pages = cache.alloc(h, cache.config.num_device_pages * P)
        cache.release(h)
        if pages is not None:
            return
        complete(cache, TransferKind.BACKUP)
    raise AssertionError("could not free the whole device")


def settle(cache: HiCache) -> None:
    """Drive to quiescence and check everything: integrity, KV, zero leaked pages."""
    while pending(cache):
        complete(cache)
    assert_no_leaks(cache)
    assert kvcheck.verify_cache(cache) == []


def host_only(cache: HiCache, tokens, ns=None) -> None:
    """Cache ``tokens`` on both tiers, then push them off the device."""
    serve_manual(cache, tokens, ns)
    complete(cache, TransferKind.BACKUP)
    evict_all_device(cache)
    m = cache.tree.match_prefix(tokens, ns)
    assert (m.device_len, m.host_len) == (0, len(tokens) // P * P)

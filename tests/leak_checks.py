"""Quiescence checks over a cache: invariants hold, nothing in flight or held, every
page accounted for. Every scenario over a cache ends in one of these.
"""

from __future__ import annotations

from hicache.cache import HiCache
from hicache.tree import IOStatus


def assert_no_leaks(cache: HiCache) -> None:
    """At quiescence: invariants hold, nothing in flight or held, every page accounted for."""
    cache.check_integrity()
    P = cache.page_size
    s = cache.stats()
    assert s["transfers_in_flight"] == 0 and s["live_requests"] == 0
    # hybrid models: component pages share the tiers' page space
    comps = {t: s.get(f"{t}_component_pages", 0) for t in ("device", "host")}
    assert s["device_pages_used"] == s["device_cached_tokens"] // P + comps["device"], (
        "device pages leaked")
    assert s["host_pages_used"] == s["host_cached_tokens"] // P + comps["host"], (
        "host pages leaked")
    for node in cache.tree.nodes():
        assert node.lock_ref == 0 and node.host_lock_ref == 0, f"lock leaked on {node}"
        assert node.io_status is IOStatus.NONE, f"IO left in flight on {node}"
    assert cache.tree.device_protected_tokens == 0 and cache.tree.host_protected_tokens == 0


def finish_transfers(cache: HiCache) -> None:
    """Complete what a manual executor holds, then wait for every transfer."""
    if cache.transfers.executor_name == "manual":
        for t in cache.transfers.executor.pending():
            cache.transfers.executor.complete(t)
    cache.wait_all()


def assert_quiescent(cache: HiCache) -> None:
    finish_transfers(cache)
    assert_no_leaks(cache)


def complete_transfers(cache: HiCache) -> None:
    """Complete what a manual executor holds, apply it, and wait for the storage reads
    that pin nodes. Unlike :func:`finish_transfers`, no ``wait_all()``."""
    if cache.transfers.executor_name == "manual":
        for t in cache.transfers.executor.pending():
            cache.transfers.executor.complete(t)
    cache.poll()
    for job in set(cache._inflight.storage_pins.values()):
        job.done.wait()
    cache.poll()

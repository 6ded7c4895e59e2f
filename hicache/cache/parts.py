"""HiCache's parts, each one object with the state it owns, and how they are wired.

:func:`compose_parts` builds them over the storage :func:`~hicache.cache.tiers.build_tiers`
made, handing each part only the collaborators it uses:

* :class:`~hicache.cache.space.TierSpace`: device and host allocation, eviction;
* :class:`~hicache.cache.inflight.InFlightTable`: the IO in flight and what it holds;
* :class:`~hicache.cache.loads.Loads`: load-back of host-only prefixes;
* :class:`~hicache.cache.writes.Writes`: backups under the write policy;
* :class:`~hicache.cache.storage.ThirdTier`: prefetch and write-behind (with storage);
* :class:`~hicache.cache.pins.Pins`, :class:`~hicache.cache.control.EventLog` (with
  ``kv_events``);
* the request lifecycle: :class:`~hicache.cache.python_lifecycle.PythonLifecycle`, and
  for bookkeeping-only caches where it applies,
  :class:`~hicache.cache.native_lifecycle.NativeLifecycle`.

The facade's ``poll`` and ``wait_all`` are handed in as callables (a part that
must wait for IO applies it through the facade, which polls every part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hicache.cache.components import ComponentBudget
from hicache.cache.control import EventLog
from hicache.cache.inflight import InFlightTable
from hicache.cache.loads import Loads
from hicache.cache.native_lifecycle import NativeLifecycle, open_native_lifecycle
from hicache.cache.pins import Pins
from hicache.cache.python_lifecycle import PythonLifecycle
from hicache.cache.space import TierSpace
from hicache.cache.stats import CacheStats
from hicache.cache.storage import ThirdTier
from hicache.cache.tiers import Tiers
from hicache.cache.writes import Writes
from hicache.config import CacheConfig


class Parts(NamedTuple):
    counters: CacheStats
    inflight: InFlightTable
    space: TierSpace
    pins: Pins
    events: EventLog | None  # None: no kv_events
    third_tier: ThirdTier | None  # None: no storage
    writes: Writes
    loads: Loads
    python: PythonLifecycle
    native: NativeLifecycle | None  # None: the Python lifecycle runs every request


def compose_parts(
    config: CacheConfig, tiers: Tiers, *, poll: Callable[[], int],
    wait_all: Callable[[], None],
) -> Parts:
    """The parts of one cache over ``tiers`` (see the module docstring)."""
    tree, page_size = tiers.tree, config.page_size
    # Bookkeeping only (no KV tensors): loads and write-through backups complete
    # as they start, so they skip the IO states and transfer records entirely.
    bookkeeping = tiers.device_pool is None
    counters = CacheStats()
    inflight = InFlightTable(tree)
    space = TierSpace(
        tree, tiers.device_allocator, tiers.host_allocator, tiers.transfers, inflight, counters,
        page_size=page_size, bookkeeping=bookkeeping, poll=poll, wait_all=wait_all,
    )
    if config.kv.component_specs and (
        config.component_device_fraction < 1 or config.component_host_fraction < 1
    ):
        space.budget = ComponentBudget(
            tree,
            {"device": int(config.component_device_fraction * config.num_device_pages),
             "host": int(config.component_host_fraction * config.num_host_pages)},
            {"device": tiers.device_allocator.free, "host": tiers.host_allocator.free},
        )
    pins = Pins(config, tree, counters)
    events = EventLog(tree, page_size, config.has_host_tier) if config.kv_events else None
    third_tier = None
    if config.storage is not None:
        third_tier = ThirdTier(
            config, tree, tiers.host_pool, space, inflight, counters, poll=poll,
            log_stored=None if events is None else events.log_storage_stored,
        )
    writes = Writes(
        config, tree, space, inflight, tiers.transfers, counters, bookkeeping=bookkeeping,
        on_backed_up=None if third_tier is None else third_tier.store,
    )
    loads = Loads(
        config, tree, space, inflight, tiers.transfers, counters, bookkeeping=bookkeeping,
        # a write-back eviction made room for a load may evict host pages
        pin_host_pages=not bookkeeping or writes.is_write_back,
    )
    python = PythonLifecycle(
        tree, space, inflight, loads, writes, third_tier, counters, page_size=page_size,
        num_layers=config.kv.num_layers, poll=poll,
    )
    # The C++ lifecycle takes the hot calls where it applies (bookkeeping only).
    native = open_native_lifecycle(config, tree, tiers.device_allocator, tiers.host_allocator)
    return Parts(counters, inflight, space, pins, events, third_tier, writes, loads, python,
                 native)

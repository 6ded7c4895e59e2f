"""Operator controls of a HiCache as a whole: reset (drop what nobody holds), KV events.

* :func:`drop_unheld` empties both tiers of everything no live request, pin or
  IO in flight holds (after a weight update the cached KV is stale). It never
  waits for or cancels IO: what is still held is kept and reported in
  :class:`ResetResult` by ``HiCache.reset``.
* :class:`EventLog` collects the KV events (hicache/events.py): the trees log
  device and host events; the log adds the storage events (a storage write
  landed) and a reset's all-cleared events, in order.

It knows nothing of transfers or the request lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from hicache.events import AllBlocksCleared, BlockStored, KVEvent, to_event

if TYPE_CHECKING:  # annotations only
    from hicache.memory import PageAllocator
    from hicache.storage.worker import EventPages
    from hicache.tree.protocol import RadixTreeLike


class ResetResult(NamedTuple):
    """What ``HiCache.reset`` dropped and what it could not drop (tokens)."""

    dropped_device_tokens: int  # device copies given up
    dropped_host_tokens: int  # host copies given up
    kept_device_tokens: int  # still on the device: locked by live requests, or IO in flight
    kept_host_tokens: int  # still in host memory: loads / storage writes in flight read them
    dropped_pins: int  # pins released (a reset drops every pin)
    discarded_prefetches: int  # storage reads in flight whose pages will be thrown away
    storage_pages_deleted: int | None  # pages cleared from the third tier; None: not asked
    storage_epoch: int | None = None  # the third tier's new epoch (new_epoch); None: not asked

    @property
    def complete(self) -> bool:
        """True when nothing cached is left in either tier."""
        return self.kept_device_tokens == 0 and self.kept_host_tokens == 0


def drop_unheld(
    tree: RadixTreeLike, device_allocator: PageAllocator, host_allocator: PageAllocator
) -> tuple[int, int]:
    """Evict every unlocked device and host copy, and free the namespaces left empty;
    (device tokens, host tokens) dropped."""
    num_device = num_host = 0
    P = tree.page_size
    while True:  # host-only children leave first, then their device-only parents can
        # (hybrid models: component pages go too, and count against the request)
        dev = tree.evict_device(tree.device_evictable_tokens
                                + P * tree.device_component_evictable_pages)
        host = tree.evict_host(tree.host_evictable_tokens
                               + P * tree.host_component_takeable_pages,
                               drop_device_resident=True)
        if dev.page_ids.shape[0]:
            device_allocator.free(dev.page_ids)
        if host.page_ids.shape[0]:
            host_allocator.free(host.page_ids)
        num_device += dev.num_evicted_tokens
        num_host += host.num_evicted_tokens
        if not dev.page_ids.shape[0] and not host.page_ids.shape[0]:
            # Namespaces left empty were freed with their last node; this frees any
            # other root that holds nothing (none a live request locks).
            tree.prune_namespaces()
            return num_device, num_host


class EventLog:
    """The cache's KV events, in order (see the module docstring)."""

    def __init__(self, tree: RadixTreeLike, page_size: int, has_host_tier: bool) -> None:
        self._tree = tree
        self._page_size = page_size
        self._has_host_tier = has_host_tier
        self._events: list[KVEvent] = []
        tree.enable_events()

    def take(self) -> list[KVEvent]:
        """Every event since the last call."""
        self._drain_tree()
        events, self._events = self._events, []
        return events

    def note_reset(self, storage_cleared: bool) -> None:
        """Log an all-cleared event for each tier a reset left empty (and storage if cleared)."""
        self._drain_tree()
        if self._tree.device_tokens == 0:
            self._events.append(AllBlocksCleared("device"))
        if self._tree.host_tokens == 0 and self._has_host_tier:
            self._events.append(AllBlocksCleared("host"))
        if storage_cleared:
            self._events.append(AllBlocksCleared("storage"))

    def log_storage_stored(self, event_pages: list[EventPages], num_pages: int) -> None:
        """Storage events for the first ``num_pages`` pages a landed write covered.

        ``event_pages``: ``(namespace, parent hash, page hashes)`` per node written,
        in the write's page order.
        """
        self._drain_tree()
        for namespace, parent, hashes in event_pages:
            if num_pages <= 0:
                break
            hashes = hashes[:num_pages]
            num_pages -= len(hashes)
            self._events.append(BlockStored(
                "storage", tuple(hashes), parent, len(hashes) * self._page_size, namespace
            ))

    def _drain_tree(self) -> None:
        """Move the tree's log into the cache's, so cache events land after them."""
        raw = self._tree.take_events()
        if raw:
            self._events.extend(map(to_event, raw))

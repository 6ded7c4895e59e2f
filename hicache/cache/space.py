"""Tier space: device and host page allocation, evicting cached prefixes to make room.

:class:`TierSpace` hands out free pages of either tier, evicting unlocked
leaves (through the tree) when the free list is short. Before it evicts it
checks that eviction can free enough (the *takeable* pages: evictable pages
less those that IO in flight or a pin holds), so that a refused allocation
evicts nothing. Under write-back a device eviction hands each leaf to a backup
first (the hook the write policy installs with :meth:`set_eviction_backup`);
its pages come free when that backup lands; when those backups fail round after
round, it drops the unbacked leaves instead (:meth:`TierSpace.drop_unbacked`), so a
broken host tier degrades write-back to recompute, never to refusal. It knows
nothing of requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.cache.components import ComponentBudget, component_pages

if TYPE_CHECKING:  # annotations only
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.stats import CacheStats
    from hicache.memory import PageAllocator
    from hicache.transfer import TransferEngine
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike
    from hicache.tree.types import Tier


class TierSpace:
    """Device and host pages for the cache (see the module docstring)."""

    def __init__(
        self,
        tree: RadixTreeLike,
        device_allocator: PageAllocator,
        host_allocator: PageAllocator,
        transfers: TransferEngine,
        inflight: InFlightTable,
        counters: CacheStats,
        *,
        page_size: int,
        bookkeeping: bool,
        poll: Callable[[], int],
        wait_all: Callable[[], None],
    ) -> None:
        self.tree = tree
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        self.page_size = page_size
        self._transfers = transfers
        self._inflight = inflight
        self._counters = counters
        self._bookkeeping = bookkeeping  # no KV: nothing is ever in flight
        self._poll = poll  # the cache's: applies finished transfers (frees pages)
        self._wait_all = wait_all  # the cache's: waits for and applies every transfer
        self._backup_for_eviction: Callable[[TreeNode], bool] | None = None
        # Hybrid models: each component's share of each tier (None: no cap below the tier)
        self.budget: ComponentBudget | None = None

    def enforce_budget(self, tier: Tier) -> None:
        """Evict what a component holds past its share of ``tier`` (hybrid models)."""
        if self.budget is not None:
            self.budget.enforce(tier)

    def set_eviction_backup(self, hook: Callable[[TreeNode], bool] | None) -> None:
        """Device eviction hands each leaf to ``hook`` (write-back): True if it took it."""
        self._backup_for_eviction = hook

    # ---------------------------------------------------------------- device
    def alloc_device(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` free device pages, evicting as needed; None having evicted nothing.

        Liveness: with no IO in flight, whenever the free pages plus the tree's
        unlocked device pages cover the request, it succeeds (every unlocked device
        page can be evicted: see the invariants in docs/design.md).
        """
        alloc = self.device_allocator
        if num_pages <= alloc.num_free_pages:
            return alloc.alloc(num_pages)
        manual = self._transfers.executor_name == "manual"
        waits = self._inflight.records and not manual
        if num_pages > alloc.num_free_pages + self.device_takeable_pages():
            if not waits:
                return None  # a refused allocation touches nothing
            # Pages held by backups in flight (write-back, or nodes that cannot be
            # evicted until their backup lands) come free once those complete.
            self._wait_all()
            if num_pages > alloc.num_free_pages + self.device_takeable_pages():
                return None
        failed_before = self._counters.backups_failed
        stalls = 0
        while num_pages > alloc.num_free_pages and stalls < 3:
            before = alloc.num_free_pages
            # Write-back hands device leaves to backups and frees them as those land, so
            # a chain is freed leaf by leaf: one round per level.
            self.evict_device(num_pages - before)
            if num_pages > alloc.num_free_pages and self._inflight.records and not manual:
                # Evicted pages come free once their backups land (a failed one is
                # offered to a backup again by the next round).
                self._wait_all()
            if alloc.num_free_pages > before:
                stalls = 0
            elif manual or self._bookkeeping:
                break  # nothing lands until the test completes it / nothing is left
            else:
                stalls += 1
        if (num_pages > alloc.num_free_pages and self._backup_for_eviction is not None
                and self._counters.backups_failed > failed_before):
            # Write-back: the eviction backups failed on every round (a host tier whose
            # copies keep failing). Refusing would refuse every request once the device
            # is full; drop unbacked leaves instead, as eviction without a host tier does,
            # and let their tokens be recomputed.
            self.drop_unbacked(num_pages - alloc.num_free_pages)
        return alloc.alloc(num_pages)

    def drop_unbacked(self, num_pages: int) -> None:
        """Evict device leaves for about ``num_pages`` pages without backing any up.

        A leaf with a host copy becomes host-only; one without is dropped (counted in
        ``unbacked_dropped_tokens``): its KV is gone from every tier and is recomputed
        when requested again. Inner nodes without a host copy are kept, as always.
        """
        dropped = 0

        def decline(node: TreeNode) -> bool:  # evict_device drops a declined leaf
            nonlocal dropped
            if not node.children:
                dropped += node.num_tokens
            return False

        result = self.tree.evict_device(num_pages * self.page_size, decline)
        if result.page_ids.shape[0]:  # (component pages may go alone: no full tokens)
            self.device_allocator.free(result.page_ids)
            self._counters.device_evicted_tokens += result.num_evicted_tokens
        self._counters.unbacked_dropped_tokens += dropped

    def device_takeable_pages(self) -> int:
        """Device pages eviction can free now: unlocked ones, less those IO pins.

        An unlocked node with IO in flight (a backup, a reload) is not taken, nor
        are its unlocked ancestors (they keep a device child until it lands).
        """
        tree = self.tree
        tokens = tree.device_evictable_tokens
        # Hybrid models: component pages on unlocked nodes go too (component eviction
        # takes them from nodes above IO in flight, not from the nodes it covers).
        pages = tree.device_component_evictable_pages
        if self._inflight.by_node:
            seen: set[TreeNode] = set()
            for node in self._inflight.by_node:
                if pages and node.lock_ref == 0:
                    pages -= sum(t.shape[0] for t in component_pages(
                        node, "device", len(tree.components)))
                while node.parent is not None and node.lock_ref == 0 and node not in seen:
                    seen.add(node)
                    if node.device_indices is not None:
                        tokens -= node.num_tokens
                    node = node.parent
        return tokens // self.page_size + pages

    def evict_device(self, num_pages: int) -> None:
        """Evict device leaves for about ``num_pages`` pages (write-back: into backups)."""
        if num_pages <= 0:
            return
        result = self.tree.evict_device(num_pages * self.page_size, self._backup_for_eviction)
        if result.page_ids.shape[0]:  # (component pages may go alone: no full tokens)
            self.device_allocator.free(result.page_ids)
            self._counters.device_evicted_tokens += result.num_evicted_tokens
        if result.num_backup_tokens:
            self._poll()  # the immediate executor has finished already

    # ------------------------------------------------------------------ host
    def alloc_host(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` free host pages, evicting host leaves; None having evicted nothing."""
        alloc = self.host_allocator
        short = num_pages - alloc.num_free_pages
        if short > 0 and short > self._host_takeable_pages():
            return None  # evicting would not make enough room: keep what is cached
        if short > 0:
            result = self.tree.evict_host(short * self.page_size)
            if result.page_ids.shape[0]:
                self.host_allocator.free(result.page_ids)
                self._counters.host_evicted_tokens += result.num_evicted_tokens
        return alloc.alloc(num_pages)

    def _host_takeable_pages(self) -> int:
        """Host pages host eviction can free now: exactly what ``evict_host`` takes.

        A host copy that is host-locked (a load, a storage write, a pin) or has IO
        in flight is not taken, nor is any host copy above it (host eviction takes
        a host copy only once its children have none: see docs/design.md). The
        tree keeps that figure (``host_takeable_tokens``).
        """
        tree = self.tree
        return tree.host_takeable_tokens // self.page_size + tree.host_component_takeable_pages

"""HiCache's request lifecycle in Python: match, load-back, alloc, insert, release.

:class:`PythonLifecycle` runs the per-request steps on the tree for every cache
(the C++ one, :mod:`hicache.cache.native_lifecycle`, takes the hot calls of a
bookkeeping-only cache and makes the same tree and free-list calls in the same
order). Each call first applies finished IO (the cache's ``poll``) and, for the
request it is made for, the failures of its loads. It moves a handle's lock
along its path as the prefix grows (a load, an insert) and makes the handle
wait on loads in flight on that path; what to load, back up or store is asked
of the parts that own it. HiCache has checked every argument first (its
module docstring draws the token ranges of a handle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.cache.handle import LoadError, PrefixHandle
from hicache.tree import TokenLike, token_key

if TYPE_CHECKING:  # annotations only
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.loads import Loads
    from hicache.cache.space import TierSpace
    from hicache.cache.stats import CacheStats
    from hicache.cache.storage import ThirdTier
    from hicache.cache.writes import Writes
    from hicache.transfer.base import Transfer
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike


class PythonLifecycle:
    """The request lifecycle on the tree (see the module docstring)."""

    def __init__(
        self,
        tree: RadixTreeLike,
        space: TierSpace,
        inflight: InFlightTable,
        loads: Loads,
        writes: Writes,
        third_tier: ThirdTier | None,
        counters: CacheStats,
        *,
        page_size: int,
        num_layers: int,
        poll: Callable[[], int],
    ) -> None:
        self._tree = tree
        self._space = space
        self._inflight = inflight
        self._loads = loads
        self._writes = writes
        self._third_tier = third_tier
        self._counters = counters
        self._page_size = page_size
        self._num_layers = num_layers
        self._poll = poll  # the cache's: applies finished transfers and storage jobs

    def match(
        self, owner: object, tokens: TokenLike, namespace: str | None, load_back: bool
    ) -> PrefixHandle:
        """Lock the longest cached prefix; start loading its host-only part (``load_back``)."""
        self._poll()
        tree = self._tree
        key = token_key(tokens, self._page_size)
        if self._third_tier is not None:
            self._third_tier.prefetch_for_match(key, namespace)
        result = tree.match_key(key, namespace)
        h = PrefixHandle(
            owner, tree, self._num_layers, key, namespace, result.device_len, result.host_len,
            result.last_device_node,
        )
        h.full_len = result.full_len
        tree.lock(result.last_device_node)
        c = self._counters
        c.requests += 1
        c.requested_tokens += len(tokens)
        c.device_hit_tokens += result.device_len
        if self._inflight.num_loading_nodes:
            self._inflight.wait_for_loads_on_path(h, result.last_device_node)
        if load_back and result.host_len:
            self._loads.start(h, result)
        # After the load: the host allocation for backups may evict host pages, and
        # the matched host-only nodes are pinned only once loading.
        self._writes.after_match(h._lock_node)
        return h

    def load_back(self, h: PrefixHandle) -> Transfer | None:
        """Match ``h``'s tokens again and load what is host-only under its lock now."""
        self._poll()
        self._loads.apply_failures(h)
        if h.prefix_len < h.device_len + h.host_len:
            result = self._tree.match_key(h.key[: 4 * (h.device_len + h.host_len)], h.namespace)
            if result.device_len > h.prefix_len:  # loaded or inserted meanwhile: take it
                self._move_lock(h, result.last_device_node)
                h.prefix_len = result.device_len
            if result.host_len and result.last_device_node is h._lock_node:
                return self._loads.start(h, result)
        return None

    def alloc(self, h: PrefixHandle, num_pages: int) -> torch.Tensor | None:
        self._poll()
        self._loads.apply_failures(h)
        return self._space.alloc_device(num_pages)

    def insert(self, h: PrefixHandle, tokens: TokenLike) -> int:
        """Cache the whole pages of ``tokens``; the tokens newly cached (see HiCache.insert)."""
        self._poll()
        self._loads.apply_failures(h)
        if h._failure_unreported:
            raise LoadError(
                f"insert: a load of the prefix failed ({h.load_error}); h.prefix_len was cut "
                f"back to {h.prefix_len}: call finish_loads(h), alloc and recompute from there"
            )
        for rec in h._loads:
            if not rec.handle.done():
                raise ValueError("insert: a prefix load is still in flight; call h.wait() first")
        P = self._page_size
        key = token_key(tokens, P)
        prefix_nbytes = 4 * h.prefix_len
        if len(key) < prefix_nbytes or not key.startswith(h.key[:prefix_nbytes]):
            raise ValueError(
                f"insert: tokens must start with the handle's {h.prefix_len}-token prefix"
            )
        num_pages = len(key) // (4 * P)
        num_prefix_pages = h.prefix_len // P
        num_owned = h.num_owned_pages
        if num_pages > num_prefix_pages + num_owned:
            raise ValueError(
                f"insert: {num_pages} whole pages of tokens, but the handle holds only "
                f"{num_prefix_pages + num_owned} pages (alloc more first)"
            )
        if num_pages == num_prefix_pages:
            return 0
        table = h.page_table()
        inserted = table[:num_pages]
        comps = h._components
        if comps is None:
            result = self._tree.insert_key(key, inserted, h.namespace)
        else:  # the window pages and checkpoints go with the full pages (hybrid models)
            given = comps.insert_pages(num_prefix_pages, num_pages)
            result = self._tree.insert_key(key, inserted, h.namespace, components=given)
            if result.unused_pages.shape[0]:
                self._space.device_allocator.free(result.unused_pages)
            comps.after_insert(num_prefix_pages, num_pages)
        cached_pages = result.num_cached_tokens // P
        if cached_pages > num_prefix_pages:  # cached meanwhile by someone else: ours are spare
            self._space.device_allocator.free(table[num_prefix_pages:cached_pages])
        rest = table[num_pages:]
        h._new_pages = [rest] if rest.shape[0] else []
        # (the lock moves onto pages a load may still be writing: deduplicated)
        self._move_lock(h, result.last_node)
        # If nothing was cached meanwhile, the tree's pages of the path are ours.
        h._prefix_pages = inserted if cached_pages <= num_prefix_pages else None
        h.prefix_len = num_pages * P
        h.key = key
        if comps is not None:
            # Once h locks its new path: the budget must not take the window tail or the
            # checkpoint h reads next (issue 45, case 3).
            self._space.enforce_budget("device")
        new_tokens = (num_pages - cached_pages) * P
        self._counters.inserted_tokens += new_tokens
        self._writes.after_insert(result.last_node)
        return new_tokens

    def release(self, h: PrefixHandle) -> None:
        """Unlock ``h``'s prefix and free the pages it owns."""
        self._tree.unlock(h._lock_node)
        for pages in h._new_pages:
            self._space.device_allocator.free(pages)

    def raise_priority(self, h: PrefixHandle, priority: int) -> None:
        self._tree.raise_priority(h._lock_node, priority)

    def _move_lock(self, h: PrefixHandle, node: TreeNode) -> None:
        """Move ``h``'s lock to ``node`` (deeper on its path); wait on loads on the way."""
        self._tree.lock(node)
        self._tree.unlock(h._lock_node)
        h._lock_node = node
        h._prefix_pages = None
        if self._inflight.num_loading_nodes:
            self._inflight.wait_for_loads_on_path(h, node)

"""Load-back: host-only prefixes into new device pages, and what a failed load undoes.

A load starts when a request's match (or ``load_back``) finds a host-only part:
the host pages are pinned (``host_lock``) while the copy reads them, the nodes
get new device pages and ``IOStatus.LOADING``, and the request's handle moves
its lock onto the loaded path. When the load lands the pins go; when it failed
the device pages hold garbage: each request waiting on it is cut back above the
failed part by its own next call (:meth:`Loads.apply_failures`), and the
nodes lose their device copy, or are loaded again where someone already cached
KV below them. It knows the write policy only as one flag (``pin_host_pages``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.cache.components import attach_loaded, load_extra_pages, transfer_pairs
from hicache.cache.inflight import InFlightIO, node_depth
from hicache.tree import IOStatus
from hicache.tree.pages import device_pages_of, host_pages_of

if TYPE_CHECKING:  # annotations only
    from hicache.cache.handle import PrefixHandle
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.space import TierSpace
    from hicache.cache.stats import CacheStats
    from hicache.config import CacheConfig
    from hicache.transfer import TransferEngine
    from hicache.transfer.base import Transfer
    from hicache.tree import MatchResult, TreeNode
    from hicache.tree.protocol import RadixTreeLike


class Loads:
    """Loads of host-only prefixes (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTreeLike,
        space: TierSpace,
        inflight: InFlightTable,
        transfers: TransferEngine,
        counters: CacheStats,
        *,
        bookkeeping: bool,
        pin_host_pages: bool,
    ) -> None:
        self._threshold_tokens = config.load_threshold_tokens
        self._page_size = config.page_size
        # Hybrid models: a load gives the nodes device pages for their host component
        # data too, moved in the same transfer (hicache.cache.components).
        self._num_components = len(config.kv.component_specs)
        self._page_nbytes = config.kv.page_nbytes
        self._tree = tree
        self._space = space
        self._inflight = inflight
        self._transfers = transfers
        self._counters = counters
        self._bookkeeping = bookkeeping  # no KV: a load is complete as it starts
        # Pin the host pages while the device room is made: a real load reads them,
        # and a write-back eviction may evict host pages.
        self._pin = pin_host_pages
        # While a load is being set up, finished storage jobs wait: a read applied then
        # would insert host pages (splitting the pinned nodes the load is about to use).
        self.setting_up = False

    def start(self, h: PrefixHandle, result: MatchResult) -> Transfer | None:
        """Load ``result``'s host-only path for ``h``; the transfer handle, or None.

        None when the load completed as it started (bookkeeping only), or was
        refused: below ``load_threshold_tokens``, or no device room (counted).
        """
        tree = self._tree
        nodes = tree.host_only_path(result)
        num_pages = sum(n.num_tokens for n in nodes) // self._page_size
        # The hit beyond what the device serves: the loaded tokens, and for a hybrid model
        # also device nodes above them whose own ends no component serves.
        num_tokens = result.host_len
        if num_tokens < self._threshold_tokens:
            self._counters.loads_refused_by_threshold += 1
            self._counters.host_hit_refused_tokens += num_tokens
            return None
        pin = self._pin
        if pin:  # the eviction below must not take them
            for node in nodes:
                tree.host_lock(node)
        num_comps = self._num_components
        extra = load_extra_pages(nodes, num_comps) if num_comps else 0
        # A hybrid hit may start loading below device nodes whose own ends serve nothing
        # (their component data left the device): h locks only the path above them, and
        # the eviction below must not take their device copy.
        anchor = nodes[0].parent
        assert anchor is not None, "a load into a root"
        hold = anchor is not result.last_device_node
        if hold:
            tree.lock(anchor)
        self.setting_up = True
        try:
            pages = self._space.alloc_device(num_pages + extra)
        finally:
            self.setting_up = False
            if hold:
                tree.unlock(anchor)
        if h._lock_node is not result.last_device_node:
            # Eviction polls: a failed load applied meanwhile cut ``h`` back above these
            # nodes (their parent may have lost its device copy). Load nothing.
            if pages is not None:
                self._space.device_allocator.free(pages)
            for node in nodes if pin else ():
                tree.host_unlock(node)
            return None
        if pages is None:
            for node in nodes if pin else ():
                tree.host_unlock(node)
            self._counters.loads_refused_no_space += 1
            self._counters.host_hit_refused_tokens += num_tokens
            return None
        off = 0
        for node in nodes:
            n = node.num_tokens // self._page_size
            tree.attach_device(node, pages[off : off + n])
            off += n
            if extra:
                off = attach_loaded(tree, node, pages, off, num_comps)
            if self._bookkeeping:
                if pin:
                    tree.host_unlock(node)
            else:
                tree.set_io_status(node, IOStatus.LOADING)
        tree.lock(nodes[-1])
        tree.unlock(h._lock_node)
        h._lock_node = nodes[-1]
        if hold and self._inflight.num_loading_nodes:
            # h reads those device nodes too: another request's load may be filling them.
            self._inflight.wait_for_loads_on_path(h, anchor)
        h._prefix_pages = None
        h.prefix_len = result.device_len + result.host_len
        self._counters.loads += 1
        self._counters.host_hit_tokens += num_tokens
        if extra:
            self._space.enforce_budget("device")
        if self._bookkeeping:  # no KV to move: the load is complete as it starts
            self._counters.load_bytes += (num_pages + extra) * self._page_nbytes
            return None
        if extra:
            pages, host_pages = transfer_pairs(nodes, num_comps)
        else:
            host_pages = torch.cat([n.host_indices for n in nodes]) if len(nodes) > 1 else (
                nodes[0].host_indices
            )
        handle = self._transfers.load(host_pages, pages)
        rec = InFlightIO(handle, "load", list(nodes), (num_pages + extra) * self._page_nbytes)
        rec.requests.append(h)
        h._loads.append(rec)
        self._inflight.track(rec)
        return handle

    def finish(self, rec: InFlightIO) -> None:
        """Apply a load that landed (or failed); ``rec`` is no longer tracked."""
        handle = rec.handle
        c = self._counters
        tree = self._tree
        for node in rec.nodes:
            tree.set_io_status(node, IOStatus.NONE)
            tree.host_unlock(node)
        if handle.error is None:
            c.load_bytes += rec.nbytes
            c.load_seconds += handle.seconds or 0.0
            return
        # The device pages hold garbage: requests fall back to the prefix above the
        # failed nodes (and recompute the rest); then the nodes lose their device copy.
        c.loads_failed += 1
        nodes = sorted(rec.nodes, key=node_depth)
        top = nodes[0].parent
        assert top is not None, "a load into a root"
        for h in rec.requests:
            # Applied by h's own next call (apply_failures): this poll may run
            # inside another request's call, and h's pages must not change under it.
            # The record stays in h._loads so that h.wait_layer raises LoadError.
            if not h.released:
                h._failed_loads.append((rec, top))
        for node in reversed(nodes):
            if node.lock_ref or any(ch.on_device for ch in node.children.values()):
                # Someone cached KV below it before the failure was seen: load it again.
                self._reload([node])
                continue
            self._space.device_allocator.free(tree.detach_device(node))

    def _reload(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            self._tree.set_io_status(node, IOStatus.LOADING)
            self._tree.host_lock(node)
        if self._num_components:
            device, host = transfer_pairs(nodes, self._num_components)
        else:
            device, host = device_pages_of(nodes), host_pages_of(nodes)
        handle = self._transfers.load(host, device)
        num_pages = device.shape[0]
        self._counters.loads_reloaded += 1
        self._inflight.track(InFlightIO(handle, "load", list(nodes), num_pages * self._page_nbytes))

    def apply_failures(self, h: PrefixHandle) -> None:
        """Cut ``h`` back above the loads of its prefix that failed (a call made for ``h``)."""
        if not h._failed_loads:
            return
        for rec, node in h._failed_loads:
            if rec in h._loads:
                h._loads.remove(rec)
            self._truncate(h, node, rec.handle.error)
            h.load_error = rec.handle.error
            h._failure_unreported = True
        h._failed_loads = []

    def _truncate(self, h: PrefixHandle, node: TreeNode, error: BaseException | None) -> None:
        tree = self._tree
        depth = sum(n.num_tokens for n in tree.path_to(node))
        if depth >= h.prefix_len:
            return
        if tree.components:  # hybrid: back to the deepest end every component serves there
            served = tree.probe_hit_key(h.key[: 4 * depth], h.namespace)
            while depth > served:
                depth -= node.num_tokens
                parent = node.parent
                assert parent is not None, "a servable end lies on the path"
                node = parent
        tree.lock(node)
        tree.unlock(h._lock_node)
        h._lock_node = node
        h._prefix_pages = None
        h.prefix_len = depth
        for pages in h._new_pages:  # computed on top of garbage: useless
            self._space.device_allocator.free(pages)
        h._new_pages = []
        if h._components is not None:
            for pages in h._components.drop_computed():
                self._space.device_allocator.free(pages)
        h.load_error = error

"""The write policies: when device pages are backed up to host memory, and retries.

* ``write_through``: every inserted path is backed up at once.
* ``write_through_selective``: a path is backed up once its nodes were hit
  ``backup_hit_threshold`` times (checked on every match).
* ``write_back``: nothing is backed up until device eviction takes a leaf; the
  leaf goes to a backup and loses its device pages when the backup lands.

:class:`Writes` is the one place that asks which policy runs. A backup keeps the
invariant that a host copy implies host copies of every ancestor: it backs up a
path root side first and stops at the first node the host tier cannot take. A
failed backup is retried where a child's host copy needs the node's; the other
nodes lose their host copy. Landed backups are handed on (``on_backed_up``, the
third tier's writes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.cache.components import backup_plan, transfer_pairs
from hicache.cache.inflight import InFlightIO, node_depth
from hicache.config import WritePolicy
from hicache.tree import IOStatus
from hicache.tree.pages import device_pages_of, host_pages_of

if TYPE_CHECKING:  # annotations only
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.space import TierSpace
    from hicache.cache.stats import CacheStats
    from hicache.config import CacheConfig
    from hicache.transfer import TransferEngine
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike


class Writes:
    """Backups as the write policy says (see the module docstring)."""

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
        on_backed_up: Callable[[list[TreeNode]], None] | None,
    ) -> None:
        self.policy = config.write_policy
        self._hit_threshold = config.backup_hit_threshold
        self._has_host_tier = config.has_host_tier
        self._page_size = config.page_size
        self._page_nbytes = config.kv.page_nbytes
        # Hybrid models: a backup copies a node's component data with its full pages, or
        # alone where its host copy exists (hicache.cache.components).
        self._num_components = len(config.kv.component_specs)
        self._tree = tree
        self._space = space
        self._inflight = inflight
        self._transfers = transfers
        self._counters = counters
        # Bookkeeping only: write-through backups complete as they start (no fence,
        # no transfer record); write-back evictions still go through a transfer.
        self._bookkeeping = bookkeeping
        self._on_backed_up = on_backed_up
        if self.policy is WritePolicy.WRITE_BACK and self._has_host_tier:
            space.set_eviction_backup(self._backup_for_eviction)

    @property
    def is_write_back(self) -> bool:
        """Device eviction starts backups (and so may evict host pages)."""
        return self.policy is WritePolicy.WRITE_BACK

    def after_match(self, node: TreeNode) -> None:
        """A request matched the path to ``node``: selective write-through backs up hot nodes."""
        if self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._backup_path(node)

    def after_insert(self, node: TreeNode) -> None:
        """A request inserted the path to ``node``: write-through backs it up."""
        if self.policy is not WritePolicy.WRITE_BACK:
            self._backup_path(node)

    def _backup_path(self, node: TreeNode) -> None:
        """Back up the nodes on ``node``'s path that the write policy wants on the host."""
        if not self._has_host_tier:
            return
        selective = self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        todo = self._tree.path_missing_host(node, self._hit_threshold if selective else 0)
        if todo:
            self._start_backup(todo)

    def _backup_for_eviction(self, node: TreeNode) -> bool:
        # A host copy needs host copies of every ancestor (docs/design.md): the
        # ancestors that lack one are backed up with it and stay on the device.
        return self._start_backup(self._tree.path_missing_host(node), evict=node)

    def _start_backup(self, nodes: list[TreeNode], evict: TreeNode | None = None) -> bool:
        """Back up ``nodes`` (one path, root side first); True if ``evict``'s backup started.

        Stops at the first node whose parent has no host copy (the invariant: a
        host copy implies host copies of every ancestor) or that the
        host tier cannot take: the rest of the path is skipped. ``evict`` (the last
        node, write-back) loses its device pages once its backup lands.
        """
        # A write-back eviction still goes through a (completed) transfer: the
        # eviction loop hands the node over and frees its pages when that is applied.
        sync = self._bookkeeping
        tree = self._tree
        num_comps = self._num_components
        started: list[TreeNode] = []
        parts: dict[TreeNode, list[int]] = {}  # nodes whose backup copies components only
        for i, node in enumerate(nodes):
            parent = node.parent
            assert parent is not None, "a backup of a root"
            if parent.parent is not None and parent.host_indices is None:
                break  # the parent first: a later backup through this path takes these
            if num_comps:
                full, comps, num_pages = backup_plan(node, num_comps)
            else:
                full, comps, num_pages = True, [], node.num_tokens // self._page_size
            # Making room must not take the parent's host copy (a host-eviction
            # candidate while its children have none): node's copy needs it. A backup
            # of component data alone must not take node's own host copy either: the
            # data is attached to it (issue 45, case 2).
            guard: TreeNode | None = None
            if num_pages > self._space.host_allocator.num_free_pages:
                if not full:
                    guard = node
                elif parent.parent is not None:
                    guard = parent
            if guard is not None:
                tree.host_lock(guard)
            try:
                host_pages = self._space.alloc_host(num_pages)
            finally:
                if guard is not None:
                    tree.host_unlock(guard)
            if host_pages is None:
                self._counters.backups_skipped += len(nodes) - i
                break
            off = 0
            if full:
                off = node.num_tokens // self._page_size
                tree.attach_host(node, host_pages[:off])
            else:
                parts[node] = comps
            for c in comps:
                n = node.component_pages(c, "device").shape[0]  # type: ignore[union-attr]
                tree.attach_component(node, c, "host", host_pages[off : off + n])
                off += n
            if not sync or node is evict:
                tree.set_io_status(node, IOStatus.BACKING_UP)
            started.append(node)
        if not started:
            return False
        if num_comps:
            self._space.enforce_budget("host")
        self._counters.backups += 1
        moving = started if not sync else [evict] if started[-1] is evict else []
        if sync:  # bookkeeping only: the host copy is complete as it starts
            copied = [n for n in started if n is not evict]
            num_pages = (transfer_pairs(copied, num_comps, parts)[0].shape[0] if num_comps
                         else sum(n.num_tokens for n in copied) // self._page_size)
            self._counters.backup_bytes += num_pages * self._page_nbytes
        if not moving:
            return False
        if num_comps:
            dev, host = transfer_pairs(moving, num_comps, parts)
        elif len(moving) == 1:
            (node,) = moving
            dev_pages, host_pages_ = node.device_indices, node.host_indices
            assert dev_pages is not None and host_pages_ is not None, (
                "a backup moves nodes on both tiers")
            dev, host = dev_pages, host_pages_
        else:
            dev = device_pages_of(moving)
            host = host_pages_of(moving)
        rec = self._submit(dev, host, moving)
        rec.parts = {n: cs for n, cs in parts.items() if n in moving} or None
        if evict is not None and started[-1] is evict:
            rec.evict = [evict]
        self._inflight.track(rec)
        return rec.evict is not None

    def _submit(self, dev: torch.Tensor, host: torch.Tensor, nodes: list[TreeNode]) -> InFlightIO:
        # Bookkeeping-only replay has no compute to wait for (and no fence to make).
        fence = None if self._bookkeeping else self._transfers.compute_fence()
        handle = self._transfers.backup(dev, host, after=fence)
        return InFlightIO(handle, "backup", nodes, dev.shape[0] * self._page_nbytes)

    def finish(self, rec: InFlightIO) -> None:
        """Apply a backup that landed (or failed); ``rec`` is no longer tracked."""
        handle = rec.handle
        c = self._counters
        tree = self._tree
        for node in rec.nodes:
            tree.set_io_status(node, IOStatus.NONE)
        if handle.error is not None:
            c.backups_failed += 1
            # Deepest first. A node whose child has a host copy keeps its own (the
            # invariant) and is backed up again; the others lose theirs and stay on
            # the device (a later backup through the path, or write-back eviction,
            # tries again).
            retry = []
            for node in sorted(rec.nodes, key=node_depth, reverse=True):
                if rec.parts is not None and node in rec.parts:
                    # Only component data was copied: the node's host copy predates it.
                    for comp in rec.parts[node]:
                        if node.component_pages(comp, "host") is not None:
                            self._space.host_allocator.free(
                                tree.detach_component(node, comp, "host"))
                elif any(ch.host_indices is not None for ch in node.children.values()):
                    retry.append(node)
                else:
                    self._space.host_allocator.free(tree.detach_host(node))
            if retry:
                self._retry(retry[::-1], rec)
            return
        c.backup_bytes += rec.nbytes
        c.backup_seconds += handle.seconds or 0.0
        if self._on_backed_up is not None:
            self._on_backed_up(rec.nodes)
        if rec.evict is not None:
            # Deepest first: parts split off in flight become leaves once their child goes.
            for node in sorted(rec.evict, key=node_depth, reverse=True):
                if node.lock_ref == 0 and not any(ch.on_device for ch in node.children.values()):
                    c.device_evicted_tokens += node.num_tokens
                    self._space.device_allocator.free(tree.detach_device(node))

    def _retry(self, nodes: list[TreeNode], failed: InFlightIO) -> None:
        """Copy ``nodes`` (root side first) into the host pages they keep, again."""
        for node in nodes:
            self._tree.set_io_status(node, IOStatus.BACKING_UP)
        if self._num_components:
            dev, host = transfer_pairs(nodes, self._num_components)
        else:
            dev = device_pages_of(nodes)
            host = host_pages_of(nodes)
        rec = self._submit(dev, host, nodes)
        if failed.evict is not None:
            rec.evict = [n for n in failed.evict if n in nodes] or None
        self._counters.backups += 1
        self._counters.backups_retried += 1
        self._inflight.track(rec)

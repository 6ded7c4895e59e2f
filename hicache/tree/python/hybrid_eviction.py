"""The hybrid tree's locks, copies and eviction: full-attention rules, component data beside.

* Locks and IO status cover a node's component data (docs/design.md, "Hybrid
  models: components"): the wrappers here move the component counters when a
  node's lock, host lock or IO status changes, and refresh its records' heap
  entries.
* A node's component data in a tier never outlives its full copy there:
  ``detach_device`` / ``detach_host`` (and eviction, through the hooks of
  :mod:`hicache.tree.python.eviction`) take it with the full copy and return its
  pages with the full pages.
* ``evict_device`` / ``evict_host`` pick, step by step, the smallest ``(rank,
  policy key)`` among the full-attention heap and every component's heap of the
  tier; a full candidate goes as in the single-kind tree, a component candidate
  loses just that component's data. Ties go to full attention, then to the
  lower component index.
* A host-only chain is merged only where neither node holds component data
  (the merge would move a node end that a window tail or a checkpoint sits at).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.checks import check_int
from hicache.tree.guards import check_component, check_tier
from hicache.tree.python.eviction import EvictTally
from hicache.tree.python.hybrid_paths import HybridPaths
from hicache.tree.python.hybrid_records import data_of
from hicache.tree.python.node import ComponentRecord, TreeNode
from hicache.tree.types import EvictResult, IOStatus, Tier


class HybridEviction(HybridPaths):
    """Locks, copies and eviction with components (see the module docstring)."""

    # ------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        first = self._path_where(node, lambda n: n.lock_ref == 0)
        super().lock(node)
        for n in first:
            self.device_component_evictable_pages -= self._component_pages_on(n, "device")

    def unlock(self, node: TreeNode) -> None:
        last = self._path_where(node, lambda n: n.lock_ref == 1)
        super().unlock(node)
        for n in last:
            self.device_component_evictable_pages += self._component_pages_on(n, "device")
            self._refresh_records(n)

    @staticmethod
    def _path_where(node: TreeNode, keep: Callable[[TreeNode], bool]) -> list[TreeNode]:
        out = []
        while node.parent is not None:
            if keep(node):
                out.append(node)
            node = node.parent
        return out

    @staticmethod
    def _host_free(node: TreeNode) -> bool:
        """Host eviction may take ``node``'s host component data (no host lock, no IO)."""
        return not node.host_lock_ref and node.io_status is IOStatus.NONE

    def _host_free_changed(self, node: TreeNode, was_free: bool) -> None:
        now_free = self._host_free(node)
        if was_free != now_free:
            pages = self._component_pages_on(node, "host")
            self.host_component_takeable_pages += pages if now_free else -pages
        self._refresh_records(node)

    def host_lock(self, node: TreeNode) -> None:
        was_free = self._host_free(node)
        super().host_lock(node)
        self._host_free_changed(node, was_free)

    def host_unlock(self, node: TreeNode) -> None:
        was_free = self._host_free(node)
        super().host_unlock(node)
        self._host_free_changed(node, was_free)

    def set_io_status(self, node: TreeNode, status: IOStatus) -> None:
        was_free = self._host_free(node)
        super().set_io_status(node, status)
        self._host_free_changed(node, was_free)

    # ------------------------------------------------------------ copies
    def detach_device(self, node: TreeNode) -> torch.Tensor:
        """:meth:`RadixTree.detach_device`; the node's device component pages follow its full pages."""
        was_free = self._host_free(node)
        pages = super().detach_device(node)
        self._host_free_changed(node, was_free)  # its IO status went back to NONE
        extra = self._drop_components(node, "device")
        return pages if extra is None else torch.cat((pages, extra))

    def detach_host(self, node: TreeNode) -> torch.Tensor:
        """:meth:`RadixTree.detach_host`; the node's host component pages follow its host pages."""
        was_free = self._host_free(node)
        pages = super().detach_host(node)
        self._host_free_changed(node, was_free)
        extra = self._drop_components(node, "host")
        return pages if extra is None else torch.cat((pages, extra))

    def path_missing_host(self, node: TreeNode, min_hit_count: int = 0) -> list[TreeNode]:
        """:meth:`RadixTree.path_missing_host`, and the nodes on both tiers whose host copy
        lacks component data their device copy has (a backup copies just those)."""
        min_hit_count = check_int("min_hit_count", min_hit_count)
        self._check_live(node, "path_missing_host")
        nodes = []
        while node.parent is not None:
            if (
                node.device_indices is not None
                and node.io_status is IOStatus.NONE
                and node.hit_count >= min_hit_count
                and (node.host_indices is None or self._host_lacks_components(node))
            ):
                nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    @staticmethod
    def _host_lacks_components(node: TreeNode) -> bool:
        assert node.components is not None, "records on every node"
        return any(r.device is not None and r.host is None for r in node.components)

    # ------------------------------------------------------------ eviction
    def _best_component(self, tier: str) -> tuple[tuple[int, ...], int] | None:
        """The best component candidate of ``tier``: (its priority, its component)."""
        best: tuple[tuple[int, ...], int] | None = None
        for c, heap in enumerate(self._comp_heaps[tier]):
            top = heap.peek(self._rank_fns[tier][c])
            if top is not None and (best is None or top[0] < best[0]):
                best = (top[0], c)
        return best

    def _evict_record(self, c: int, tier: str, tally: EvictTally) -> int:
        """Evict the top candidate of component ``c``'s heap in ``tier``; its page ids."""
        rec: ComponentRecord | None = self._comp_heaps[tier][c].pop(self._rank_fns[tier][c])
        assert rec is not None, "peeked at just before"
        ids = data_of(rec, tier)
        assert ids is not None, "a candidate holds data"
        self._set_data(rec.node, c, tier, None)
        tally.freed.append(ids)
        return ids.shape[0]

    def evict_component(self, c: int, tier: Tier, num_pages: int) -> EvictResult:
        """Evict component ``c``'s data in ``tier`` only, in its heap's order (rank -1
        first), until at least ``num_pages`` page ids are freed or none is left."""
        check_tier(tier, "evict_component")
        check_component(c, len(self.components), "evict_component")
        need = check_int("num_pages", num_pages)
        self._refuse_reentry("evict_component", backup_may=True)
        tally = EvictTally()
        while need > 0 and self._comp_heaps[tier][c].peek(self._rank_fns[tier][c]) is not None:
            need -= self._evict_record(c, tier, tally)
        return tally.result()

    def evict_device(
        self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None
    ) -> EvictResult:
        """:meth:`RadixTree.evict_device` over full leaves and component data in one order.

        Frees at least ``ceil(num_tokens / page_size)`` page ids (full or component)
        when the tree has them; ``num_evicted_tokens`` counts full-attention tokens.
        """
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_device")
        tally = EvictTally()
        node = None
        try:
            while need > 0:
                full = self._device_heap.peek(self._device_rank)
                comp = self._best_component("device")
                if comp is not None and (full is None or comp[0] < full[0]):
                    need -= self._evict_record(comp[1], "device", tally)
                    continue
                if full is None:
                    break
                node = self._device_heap.pop(self._device_rank)
                assert node is not None, "peeked at just before"
                need -= self._evict_device_node(node, need, backup, tally)
        except BaseException:
            self._after_failed_eviction(tally, node)
            raise
        for node in tally.skipped:
            self._device_heap.push(node)
        self._maybe_compact()
        return tally.result()

    def evict_host(self, num_tokens: int, drop_device_resident: bool = True) -> EvictResult:
        """:meth:`RadixTree.evict_host` over full copies and component data in one order."""
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_host", backup_may=True)
        tally = EvictTally()
        while need > 0:
            full = self._host_heap.peek(self._host_rank)
            comp = self._best_component("host")
            if comp is not None and (full is None or comp[0] < full[0]):
                if comp[0][0] >= 1 and not drop_device_resident:
                    break
                need -= self._evict_record(comp[1], "host", tally)
                continue
            if full is None:
                break
            node = full[1]
            if node.device_indices is not None and not drop_device_resident:
                break
            self._host_heap.pop(self._host_rank)
            need -= self._evict_host_node(node, need, tally)
        return tally.result()

    def _merge_host_chain(self, node: TreeNode) -> None:
        if len(node.children) != 1:
            return
        (child,) = node.children.values()
        if self._component_pages_on(node, "host") or self._component_pages_on(child, "host"):
            return
        super()._merge_host_chain(node)
        if child.parent is None:  # merged: child's children are node's now
            assert node.components is not None and child.components is not None, "records"
            for mine, theirs in zip(node.components, child.components, strict=True):
                mine._dev_children, mine._host_children = theirs._dev_children, theirs._host_children
